"""What a prefill needs beyond the weights and the KV cache: measured once, before the cache.

On CUDA the KV budget is what ``--gpu-memory-utilization`` leaves of the card after the
weights *and* the activations of the largest prefill the scheduler admits
(``max_num_batched_tokens`` prompt tokens in one forward), as vLLM's profile run measures
it: without that reserve the cache would take the memory the first large prefill needs,
and that prefill would run out of memory. ``activation_peak`` runs one dummy text prefill
of that many tokens on a temporary cache just big enough for it and reads the allocator's
peak. The vision tower runs before the prefill (its activations are freed by then), so its
own peak is not added: an image too large for what is left fails alone with a 503
(``faults.OutOfMemory``), never the engine.

On CPU nothing is measured (0): the budget there is a share of the RAM, and the allocator
does not keep the statistics.
"""

from __future__ import annotations

import logging

import torch

from vlmserve.engine.core.block_manager import blocks_for
from vlmserve.engine.models.runner import DecoderRunner, PrefillRow

__all__ = ["activation_peak", "dummy_prefill"]

log = logging.getLogger(__name__)


def dummy_prefill(runner: DecoderRunner, tokens: int, block_size: int) -> torch.Tensor:
    """One text prefill of ``tokens`` tokens (token id 0) on a temporary cache that holds just
    them; the runner's own cache (if any) is put back after. -> its logits [1, V]."""
    own = runner.cache
    blocks = blocks_for(tokens, block_size) + 1  # and the null block
    runner.allocate_cache(blocks, block_size)
    try:
        ids = torch.zeros(tokens, dtype=torch.long, device=runner.device)
        row = PrefillRow(
            embeds=runner.embed(ids),
            positions=None,
            slots=list(range(block_size, block_size + tokens)),
        )
        with torch.inference_mode():
            return runner.prefill([row])
    finally:
        if runner.cache is not None:
            runner.cache.release()
        runner.cache = own


def activation_peak(runner: DecoderRunner, tokens: int, block_size: int) -> int:
    """Bytes a prefill of ``tokens`` tokens allocates beyond the weights and its own KV (the
    reserve the KV budget leaves free); 0 where it is not measured (not CUDA)."""
    device = runner.device
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    kv = runner.block_bytes(block_size) * (blocks_for(tokens, block_size) + 1)
    dummy_prefill(runner, tokens, block_size)
    torch.cuda.synchronize(device)
    peak = max(0, torch.cuda.max_memory_allocated(device) - before - kv)
    torch.cuda.empty_cache()
    log.info(
        "a prefill of %d tokens takes %.1f MiB of activations: kept out of the KV budget",
        tokens,
        peak / 2**20,
    )
    return peak
