"""Which KV-cache blocks each sequence owns (nano-vllm's ``BlockManager``, without prefix
hashing): fixed-size blocks, a free list, a block table per sequence.

Token ``i`` of a sequence lives in block ``table[i // block_size]`` at offset
``i % block_size``; its flat *slot* in the cache is ``block * block_size + offset``.
Block 0 is the null block: never handed out, never written, always zeros. Decode pads
block tables with it, so padded key/value positions read zeros (masked out, multiplied
by 0, and ``0 * NaN`` would be NaN).

Freed blocks go back on top of the free list and are handed out first (LIFO): the cache
tensors are allocated once for the whole budget, and on CPU their pages are only touched
(resident) once a block is first used, so a light load keeps a small working set.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["NULL_BLOCK", "BlockManager", "blocks_for"]

NULL_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() -> 1, 2, ..
        self.fresh: list[int] = []  # handed out since the runner last zeroed them

    @property
    def usable(self) -> int:
        """Blocks a sequence can own (all but the null block)."""
        return self.num_blocks - 1

    @property
    def used(self) -> int:
        return self.usable - len(self.free)

    @property
    def usage(self) -> float:
        return self.used / self.usable

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def fits(self, tokens: int) -> bool:
        """Whether ``tokens`` could ever be held (the whole cache, nothing else in it)."""
        return self.blocks_for(tokens) <= self.usable

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self.free)

    def allocate(self, table: list[int], tokens: int) -> None:
        """Grow ``table`` (in place) to hold ``tokens`` tokens."""
        need = self.blocks_for(tokens) - len(table)
        if need > len(self.free):
            raise MemoryError(f"KV cache: {need} blocks needed, {len(self.free)} free")
        for _ in range(need):
            table.append(self._take())

    def can_append(self, table: list[int], length: int) -> bool:
        """Whether token ``length`` (0-based) can be written: its block exists or one is free."""
        return length < len(table) * self.block_size or bool(self.free)

    def append_slot(self, table: list[int], length: int) -> int:
        """Make room for token ``length``; return its slot."""
        if length >= len(table) * self.block_size:
            self.allocate(table, length + 1)
        return self.slot(table, length)

    def slot(self, table: list[int], index: int) -> int:
        return table[index // self.block_size] * self.block_size + index % self.block_size

    def free_table(self, table: list[int]) -> None:
        """Give back every block of ``table`` (emptied in place); last block on top."""
        self.free.extend(table)
        table.clear()

    def take_fresh(self) -> list[int]:
        """Blocks handed out since the last call (the runner zeroes them before use)."""
        fresh, self.fresh = self.fresh, []
        return fresh

    def _take(self) -> int:
        block = self.free.pop()
        self.fresh.append(block)
        return block

    def check(self, tables: Iterable[list[int]]) -> None:
        """No block owned twice, none both owned and free (an invariant; O(blocks))."""
        owned = [b for table in tables for b in table]
        if len(set(owned)) != len(owned) or set(owned) & set(self.free) or NULL_BLOCK in owned:
            raise AssertionError("KV block tables overlap or hold free blocks")
        if len(owned) + len(self.free) != self.usable:
            raise AssertionError(f"{len(owned)} owned + {len(self.free)} free != {self.usable}")
