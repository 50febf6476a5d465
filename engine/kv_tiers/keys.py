"""Tier keys: the device pool's salted chained block hash, bound to what makes a block's bytes compatible.

A block's bytes are only meaningful to the same model weights, dtype, cache layout (layers, per-token
shapes, block size) and tensor-parallel slice. The fingerprint hashes all of that; a tier key is
``blake2b(fingerprint, block_hash)``. The block hash already carries the tenant's salt (every block of a
chain), so a key written for one tenant can only be found with that tenant's salt, and a key written by
another model or layout is never found at all: nothing is compared, it is a different key.
"""

import hashlib
import os
from collections.abc import Iterable

KEY_BYTES = 32


def checkpoint_identity(model: str, random_weights: str | None, seed: int, quantization: str | None) -> str:
    """What names the weights: the checkpoint directory with its weight files' names, sizes and modification
    times (a checkpoint rewritten in place is another model), or the random-weight preset and its seed."""
    if random_weights:
        return f"random:{random_weights}:seed={seed}:q={quantization}"
    path = os.path.abspath(model)
    files = []
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith((".safetensors", ".bin", ".json")):
                st = os.stat(os.path.join(path, name))
                files.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return f"dir:{path}:{','.join(files)}:q={quantization}"


def layout_fingerprint(model_identity: str, dtype: str, per_layer_specs: Iterable[tuple[str, tuple]],
                       block_size: int, tp_size: int, tp_rank: int) -> bytes:
    """16 bytes naming a block layout: model identity, cache dtype(s), each layer's cache spec
    (``(dtype name, per-token shapes)``), tokens per block, tensor-parallel size and rank."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((model_identity, dtype, tuple(per_layer_specs), block_size, tp_size, tp_rank)).encode())
    return h.digest()


def tier_key(fingerprint: bytes, block_hash: bytes) -> bytes:
    """The key of one block in every tier (32 bytes)."""
    return hashlib.blake2b(fingerprint + block_hash, digest_size=KEY_BYTES).digest()
