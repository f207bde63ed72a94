"""Which KV-cache blocks each sequence owns (nano-vllm's ``BlockManager``): fixed-size
blocks, a free list, a block table per sequence, and (optionally) prefix caching.

Token ``i`` of a sequence lives in block ``table[i // block_size]`` at offset
``i % block_size``; its flat *slot* in the cache is ``block * block_size + offset``.
Block 0 is the null block: never handed out, never written, always zeros. Decode pads
block tables with it, so padded key/value positions read zeros (masked out, multiplied
by 0, and ``0 * NaN`` would be NaN).

Freed blocks go back on top of the free list and are handed out first (LIFO): the cache
tensors are allocated once for the whole budget, and on CPU their pages are only touched
(resident) once a block is first used, so a light load keeps a small working set.

**Prefix caching** (``prefix_caching=True``, vLLM's automatic prefix caching): a full block
of a prompt is *registered* under the hash of everything before and in it
(``prefix.block_hashes``) once its K/V is computed. A later prompt that starts the same way
*shares* those blocks (reference counts) instead of computing them again. A registered block
whose last owner leaves is *idle*: still findable, and handed out again (its hash dropped)
only when no never-registered block is free, least recently used first. Idle blocks count
as available for admission.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["NULL_BLOCK", "BlockManager", "blocks_for"]

NULL_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks  # including the null block
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() -> 1, 2, ..
        self.fresh: list[int] = []  # handed out since the runner last zeroed them
        self.refs = [0] * num_blocks  # tables owning each block
        self.by_hash: dict[bytes, int] = {}  # registered blocks by prefix hash
        self.hash_of: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # registered, unowned; LRU first

    @property
    def usable(self) -> int:
        """Blocks a sequence can own (all but the null block)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks that can be handed out now: free, or idle in the prefix cache."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        return self.usable - self.available

    @property
    def usage(self) -> float:
        return self.used / self.usable

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def fits(self, tokens: int) -> bool:
        """Whether ``tokens`` could ever be held (the whole cache, nothing else in it)."""
        return self.blocks_for(tokens) <= self.usable

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.available

    def allocate(self, table: list[int], tokens: int) -> None:
        """Grow ``table`` (in place) to hold ``tokens`` tokens."""
        need = self.blocks_for(tokens) - len(table)
        if need > self.available:
            raise MemoryError(f"KV cache: {need} blocks needed, {self.available} free")
        for _ in range(need):
            table.append(self._take())

    def can_append(self, table: list[int], length: int) -> bool:
        """Whether token ``length`` (0-based) can be written: its block exists or one is free."""
        return length < len(table) * self.block_size or self.available > 0

    def append_slot(self, table: list[int], length: int) -> int:
        """Make room for token ``length``; return its slot."""
        if length >= len(table) * self.block_size:
            self.allocate(table, length + 1)
        return self.slot(table, length)

    def slot(self, table: list[int], index: int) -> int:
        return table[index // self.block_size] * self.block_size + index % self.block_size

    def free_table(self, table: list[int]) -> None:
        """Give back every block of ``table`` (emptied in place); last block on top. A
        registered block left without owners stays findable (idle)."""
        for block in table:
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            if block in self.hash_of:
                self.idle[block] = None
            else:
                self.free.append(block)
        table.clear()

    def take_fresh(self) -> list[int]:
        """Blocks handed out since the last call (the runner zeroes them before use)."""
        fresh, self.fresh = self.fresh, []
        return fresh

    def _take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:  # reuse the least recently used idle block: its cached prefix is forgotten
            block, _ = self.idle.popitem(last=False)
            del self.by_hash[self.hash_of.pop(block)]
        self.refs[block] = 1
        self.fresh.append(block)
        return block

    # --- prefix caching -------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The registered blocks of the longest run of ``hashes`` from the first (nothing
        changes: ``share`` takes them)."""
        found: list[int] = []
        for h in hashes if self.prefix_caching else ():
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def idle_among(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if b in self.idle)

    def share(self, table: list[int], blocks: list[int]) -> None:
        """Start an empty ``table`` with ``blocks`` (found by ``lookup``): owned, not fresh."""
        for block in blocks:
            self.idle.pop(block, None)
            self.refs[block] += 1
            table.append(block)

    def register(self, table: list[int], hashes: list[bytes]) -> None:
        """After a prefill: the full prompt blocks of ``table`` are findable by ``hashes``
        (a hash already registered keeps its first block; this one stays private)."""
        if not self.prefix_caching:
            return
        for block, h in zip(table, hashes, strict=False):
            if h in self.by_hash or block in self.hash_of:
                continue
            self.by_hash[h] = block
            self.hash_of[block] = h

    def check(self, tables: Iterable[list[int]]) -> None:
        """Every block owned as often as ``refs`` says, none both owned and available, and
        the books balance (an invariant; O(blocks))."""
        owned = [b for table in tables for b in table]
        counts: dict[int, int] = {}
        for b in owned:
            counts[b] = counts.get(b, 0) + 1
        spare = set(self.free) | set(self.idle)
        if set(counts) & spare or NULL_BLOCK in counts or len(spare) != self.available:
            raise AssertionError("KV block tables overlap the free blocks or hold the null one")
        if any(self.refs[b] != n for b, n in counts.items()):
            raise AssertionError("KV block reference counts disagree with the tables")
        if len(counts) + self.available != self.usable:
            raise AssertionError(f"{len(counts)} owned + {self.available} spare != {self.usable}")
