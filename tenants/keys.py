"""API keys: ``mg-`` + 43 url-safe characters (32 random bytes); only the SHA-256 is stored."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "mg-"
DISPLAY_PREFIX_LEN = 8


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_secret() -> str:
    """32 random bytes as 64 hex characters: a tenant's prefix-cache salt, a deployment's identity."""
    return secrets.token_hex(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    return key[:DISPLAY_PREFIX_LEN]


def looks_like_key(key: str) -> bool:
    return key.startswith(KEY_PREFIX) and len(key) > len(KEY_PREFIX) + 16
