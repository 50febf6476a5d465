"""One KV block of the pool as the scheduler sees it: an id, a ref count, and what its cached prefix is."""


class Block:
    """``block_hash``: the prefix-cache key while the block holds a registered full block (None: private or
    unwritten). ``tenant``: whose prefix it holds. ``priority``: the most urgent priority class (lower is more
    urgent) of the requests that used the cached block, which the pool's ``priority`` eviction policy reads."""

    __slots__ = ("block_id", "ref_count", "block_hash", "tenant", "priority")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.tenant = ""
        self.priority = 0

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"
