"""BlockPool: the free list of KV cache block ids, and the blocks each sequence holds."""

from __future__ import annotations

from collections import deque

from engine_ref.utils import cdiv


class BlockPool:
    """Hands out block ids ``0..num_blocks-1``; each id is held by at most one owner at a time."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of at least one token, "
                             f"got num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, owner: int, num_tokens: int) -> int:
        """How many more blocks ``owner`` needs to hold ``num_tokens`` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self._tables.get(owner, ())))

    def can_allocate(self, owner: int, num_tokens: int) -> bool:
        return self.blocks_needed(owner, num_tokens) <= len(self._free)

    def allocate(self, owner: int, num_tokens: int) -> list[int]:
        """Grow ``owner``'s block table to cover ``num_tokens`` tokens; return the whole table."""
        needed = self.blocks_needed(owner, num_tokens)
        if needed > len(self._free):
            raise MemoryError(f"{needed} KV cache blocks needed, {len(self._free)} free")
        table = self._tables.setdefault(owner, [])
        table.extend(self._free.popleft() for _ in range(needed))
        return table

    def block_table(self, owner: int) -> list[int]:
        return self._tables.get(owner, [])

    def free(self, owner: int) -> None:
        """Return all of ``owner``'s blocks to the pool (a no-op for an unknown owner)."""
        self._free.extend(self._tables.pop(owner, ()))
