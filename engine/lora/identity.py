"""What an adapter's weights are, as one short digest: the content of its config and weights files.

The prefix cache keys blocks computed under an adapter by its registration (``engine.core.lora_residency``), and
the disk tier keeps them across restarts: an adapter whose files were replaced in place (the same name, the same
directory, new weights) must never find the blocks its earlier weights computed. Its name and directory cannot
tell; its bytes can. Computed once per registration, when the adapter is added.
"""

import hashlib
import os

from engine.lora.peft_format import CONFIG_FILE, WEIGHTS_FILE

CHUNK = 1 << 20


def adapter_digest(path: str) -> str | None:
    """32 hex characters: BLAKE2b over the adapter's config and weights files (their names, sizes and bytes); None
    if a file cannot be read (the adapter's own check says what is wrong)."""
    h = hashlib.blake2b(digest_size=16)
    try:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            with open(os.path.join(path, name), "rb") as f:
                h.update(name.encode() + os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
                while chunk := f.read(CHUNK):
                    h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()
