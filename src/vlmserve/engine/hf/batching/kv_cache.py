"""Per-row KV slots: row ``s`` of the batch keeps its keys/values in slot ``s`` of each layer.

Layout per layer: ``k[l], v[l]: [slots, kv_heads, capacity, head_dim]``. A row writes its
token ``i`` at column ``i`` of its slot, so joining the batch copies nothing and leaving it
moves one row (the last slot fills the hole; the batch stays dense in slots ``0..B-1``).
Both dimensions grow by doubling as needed; the engine drops the buffers when it idles
with a large cache. A paged cache (nano-vllm's block manager) replaces this by swapping
``slot`` for a block table and ``column`` for a slot mapping; the runner only calls ``write_*``,
``keys``/``values`` and ``move``.
"""

from __future__ import annotations

import torch

__all__ = ["SlotKVCache"]


def _next_pow2(n: int, floor: int) -> int:
    size = floor
    while size < n:
        size *= 2
    return size


class SlotKVCache:
    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0

    def reserve(self, slots: int, columns: int) -> None:
        """Make room for ``slots`` rows of ``columns`` tokens (copying on growth)."""
        if slots <= self.slots and columns <= self.capacity:
            return
        new_slots = max(self.slots, _next_pow2(slots, 4))
        new_cap = max(self.capacity, _next_pow2(columns, 256))
        # zeros, not empty: attention multiplies masked-out values by 0, and 0 * NaN is NaN
        shape = (new_slots, self.kv_heads, new_cap, self.head_dim)
        for store in (self.k, self.v):
            for layer in range(self.layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer < len(store):
                    grown[: self.slots, :, : self.capacity] = store[layer]
                    store[layer] = grown
                else:
                    store.append(grown)
        self.slots, self.capacity = new_slots, new_cap

    def write_prompt(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, T, head_dim] -> columns 0..T-1 of ``slot``."""
        t = k.shape[1]
        self.k[layer][slot, :, :t] = k
        self.v[layer][slot, :, :t] = v

    def write_step(
        self,
        layer: int,
        slots: torch.Tensor,
        columns: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """One token per row: k, v: [B, kv_heads, head_dim] at (slots[b], columns[b])."""
        self.k[layer][slots, :, columns] = k
        self.v[layer][slots, :, columns] = v

    def keys(self, layer: int, slot: int, length: int) -> torch.Tensor:
        return self.k[layer][slot : slot + 1, :, :length]  # [1, kv_heads, length, head_dim]

    def values(self, layer: int, slot: int, length: int) -> torch.Tensor:
        return self.v[layer][slot : slot + 1, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` columns of slot ``src`` into slot ``dst``."""
        for layer in range(self.layers):
            self.k[layer][dst, :, :length] = self.k[layer][src, :, :length]
            self.v[layer][dst, :, :length] = self.v[layer][src, :, :length]

    def release(self) -> None:
        self.k, self.v = [], []
        self.slots = self.capacity = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
