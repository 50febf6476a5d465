"""Shared building blocks of the model families."""
