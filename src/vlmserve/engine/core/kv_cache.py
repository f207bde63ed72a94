"""The paged KV cache: every layer's keys and values in fixed-size blocks, one budget.

Layout: ``k, v: [layers, num_blocks, block_size, kv_heads, head_dim]``, allocated once for
the whole budget (the budget is a hard cap: nothing grows later). Which blocks a sequence
owns is ``BlockManager``'s business; the cache only knows flat *slots*
(``block * block_size + offset``):

- ``write(layer, slots, k, v)`` scatters one row per token;
- ``gather(layer, tables)`` returns each row's keys/values, its blocks in table order;
- ``clear(blocks)`` zeroes blocks before a new owner uses them, so positions past a row's
  length read zeros (masked out and multiplied by 0: ``0 * NaN`` would be NaN).

On CPU the tensors are ``torch.empty`` (pages become resident only once written), and the
null block 0 is zeroed at once; on CUDA the whole budget is reserved up front.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from vlmserve.engine.core.block_manager import NULL_BLOCK, blocks_for
from vlmserve.errors import InvalidRequest

__all__ = ["DEFAULT_BLOCK_SIZE", "KVBudget", "PagedKVCache", "auto_budget", "block_bytes"]

DEFAULT_BLOCK_SIZE = 16  # tokens per block (vLLM's default on GPU and CPU)
CPU_BUDGET_CAP = 4 * 2**30  # auto budget on CPU: min(4 GiB, a quarter of available RAM)
CPU_BUDGET_RAM_FRACTION = 0.25
GPU_MEMORY_UTILIZATION = 0.9  # auto budget on CUDA: free memory above 10% of the card


def block_bytes(
    layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one block: keys and values of ``block_size`` tokens in every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * head_dim * block_size * itemsize


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_budget(device: torch.device, utilization: float = GPU_MEMORY_UTILIZATION) -> int:
    """The KV budget when none is set: on CPU min(4 GiB, 1/4 of available RAM) (vLLM's
    ``VLLM_CPU_KVCACHE_SPACE`` is a fixed 4 GiB); on CUDA what ``mem_get_info`` says is
    free beyond ``1 - utilization`` of the card (``--gpu-memory-utilization``; the weights are
    loaded already, so they count in it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - (1 - utilization) * total))
    return int(min(CPU_BUDGET_CAP, CPU_BUDGET_RAM_FRACTION * _available_ram()))


_SETTING = "--kv-cache-memory / VLMSERVE_KV_CACHE_MEMORY"
_GPU_SETTING = "--gpu-memory-utilization / VLMSERVE_GPU_MEMORY_UTILIZATION"


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The KV budget in blocks: ``num_blocks`` (the null block included) of ``block_bytes``."""

    budget: int  # bytes: the setting, or the automatic default
    block_size: int  # tokens per block
    block_bytes: int
    num_blocks: int

    @classmethod
    def plan(
        cls,
        requested: int | None,
        block_bytes: int,
        block_size: int,
        device: torch.device,
        utilization: float = GPU_MEMORY_UTILIZATION,
        reserve: int = 0,
    ) -> KVBudget:
        """``requested`` bytes (None or 0: ``auto_budget`` less ``reserve``, the profiled
        activation peak) -> whole blocks. At least two (the null block and one), else a
        ``ValueError`` naming the setting."""
        budget = int(requested) if requested else max(0, auto_budget(device, utilization) - reserve)
        num_blocks = budget // block_bytes
        if num_blocks < 2:
            raise ValueError(_too_small(budget, block_bytes, block_size, device, reserve))
        return cls(budget, block_size, block_bytes, num_blocks)

    @property
    def nbytes(self) -> int:
        """Bytes the cache allocates (whole blocks, so at most ``budget``)."""
        return self.num_blocks * self.block_bytes

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence can hold with the whole cache to itself."""
        return (self.num_blocks - 1) * self.block_size

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """``InvalidRequest`` (400) when prompt + max_tokens can never be held, even alone."""
        need = prompt_tokens + max_tokens
        if blocks_for(need, self.block_size) <= self.num_blocks - 1:
            return
        raise InvalidRequest(
            f"this request needs KV cache for {need} tokens ({prompt_tokens} prompt + "
            f"{max_tokens} max_tokens), more than the model's whole KV cache budget of "
            f"{_mib(self.budget)} MiB holds ({self.max_tokens} tokens); lower max_tokens or "
            f"shorten the prompt (fewer or smaller images), or raise {_SETTING} (bytes)",
            param="max_tokens",
            code="kv_cache_too_small",
        )


def _too_small(
    budget: int, block_bytes: int, block_size: int, device: torch.device, reserve: int
) -> str:
    settings = _SETTING + (f", or {_GPU_SETTING}" if device.type == "cuda" else "")
    reserved = f" (after {_mib(reserve)} MiB kept for a prefill's activations)" if reserve else ""
    return (
        f"KV cache budget of {_mib(budget)} MiB{reserved} is too small: a block of "
        f"{block_size} tokens takes {block_bytes} bytes and at least 2 are needed; raise "
        f"{settings}"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


class PagedKVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        # per layer, views made once: by slot [num_blocks * block_size, kv_heads, head_dim]
        # and by block [num_blocks, block_size * kv_heads * head_dim]
        by_slot = (layers, num_blocks * block_size, kv_heads, head_dim)
        by_block = (layers, num_blocks, block_size * kv_heads * head_dim)
        self._k_slots = list(self.k.view(by_slot).unbind(0))
        self._v_slots = list(self.v.view(by_slot).unbind(0))
        self._k_blocks = list(self.k.view(by_block).unbind(0))
        self._v_blocks = list(self.v.view(by_block).unbind(0))
        # decode gathers into these, reused by every layer and step: a fresh 1 MB tensor per
        # layer cost ~1 ms in page faults (measured: 8 rows x 9 blocks, medium checkpoint)
        self._k_work = torch.empty(0, dtype=dtype, device=device)
        self._v_work = torch.empty(0, dtype=dtype, device=device)
        self._k_up = self._v_up = torch.empty(0, device=device)  # ``gather(..., dtype)``
        self.clear([NULL_BLOCK])

    def clear(self, blocks: list[int]) -> None:
        """Zero ``blocks`` in every layer (before a new owner writes them)."""
        if not blocks:
            return
        # as rows of [layers * num_blocks, block elements]: one index_fill_ per tensor
        rows = [layer * self.num_blocks + b for layer in range(self.layers) for b in blocks]
        index = torch.tensor(rows, device=self.k.device)
        self.k.view(self.layers * self.num_blocks, -1).index_fill_(0, index, 0)
        self.v.view(self.layers * self.num_blocks, -1).index_fill_(0, index, 0)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [N] flat slots; k, v: [N, kv_heads, head_dim] -> the cache."""
        self._k_slots[layer].index_copy_(0, slots, k)
        self._v_slots[layer].index_copy_(0, slots, v)

    def gather(
        self, layer: int, tables: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tables: [B, MB] block ids (padded with the null block) -> keys and values
        [B, kv_heads, MB * block_size, head_dim]: transposed views of a gathered copy, valid
        until the next ``gather`` (one workspace for all layers). ``dtype``: the copy in that
        dtype instead (a bf16 cache's decode attention in float32), through a second
        workspace, also reused."""
        b, mb = tables.shape
        flat = tables.view(-1)
        if self._k_work.shape[0] < b * mb:
            rows = max(b * mb, 2 * self._k_work.shape[0])
            self._k_work = self._k_blocks[layer].new_empty(rows, self._k_blocks[layer].shape[1])
            self._v_work = torch.empty_like(self._k_work)
        shape = (b, mb * self.block_size, self.kv_heads, self.head_dim)
        keys = torch.index_select(self._k_blocks[layer], 0, flat, out=self._k_work[: b * mb])
        values = torch.index_select(self._v_blocks[layer], 0, flat, out=self._v_work[: b * mb])
        if dtype is not None and dtype != keys.dtype:
            keys, values = self._upcast(keys, values, dtype)
        return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)

    def _upcast(
        self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = keys.shape[0]
        if self._k_up.shape[0] < n or self._k_up.dtype != dtype:
            self._k_up = keys.new_empty(self._k_work.shape, dtype=dtype)
            self._v_up = torch.empty_like(self._k_up)
        return self._k_up[:n].copy_(keys), self._v_up[:n].copy_(values)

    def release(self) -> None:
        self.k = self.v = torch.empty(0)
        self._k_slots, self._v_slots, self._k_blocks, self._v_blocks = [], [], [], []
        self._k_work = self._v_work = self._k_up = self._v_up = torch.empty(0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))
