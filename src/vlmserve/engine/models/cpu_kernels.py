"""Which of the C library's kernels (``cpu_attention.py``) a runner runs on on CPU.

One library holds decode attention over the paged cache (``cpu_decode.c``), bf16 prefill
attention (``cpu_prefill.c``, also in a Qwen vision tower) and the decode rows' bf16 linear
layers (``cpu_linear.c``). ``use_cpu_kernels`` loads it (built once per machine, cached)
and gives each part what it takes; ``settle_linears`` is also how a runner that gets no
library (``--enforce-eager``, no compiler) packs the weights that waited for it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from vlmserve.engine.models.cpu_attention import CpuPagedAttention, KernelBuildError
from vlmserve.engine.models.cpu_vision import use_in_vision_tower
from vlmserve.engine.models.graphs import base_decode
from vlmserve.engine.models.linear import Linear

if TYPE_CHECKING:
    from vlmserve.engine.models.runner import DecoderRunner

__all__ = ["linears_of", "settle_linears", "use_cpu_kernels"]

log = logging.getLogger(__name__)


def linears_of(runner: DecoderRunner) -> list[Linear]:
    """The LM head and every layer's four fused linears."""
    layers = runner.layers
    return [runner.lm_head, *(f for y in layers for f in (y.qkv, y.o, y.gate_up, y.down))]


def settle_linears(runner: DecoderRunner, kernel: CpuPagedAttention | None = None) -> int:
    """Decode rows' products on ``kernel``'s bf16 product (``cpu_linear.c``) where it takes
    the weight; a weight still waiting for it (``pack_later``) is packed for oneDNN now.
    -> how many linears the kernel took."""
    took = 0
    for linear in linears_of(runner):
        if kernel is not None and linear.use_kernel(kernel):
            took += 1
        else:
            linear.settle()
    return took


def use_cpu_kernels(runner: DecoderRunner) -> str:
    """Load the library and hand its kernels to ``runner``: decode attention in place (else
    it gathers each row's blocks as before), bf16 prefill attention, the decode rows' bf16
    linears. -> how decode runs, for the log."""
    try:
        kernel = CpuPagedAttention()
    except (KernelBuildError, OSError) as exc:
        settle_linears(runner)
        log.warning("decode attention gathers each row's blocks: building failed (%s)", exc)
        return f"gathered attention (building the CPU kernel failed: {type(exc).__name__})"
    took = settle_linears(runner, kernel)
    linears = f"; bf16 linears for decode rows ({took} weights)" if took else ""
    if not base_decode(runner):
        return "gathered attention (the model's own decode attention)" + linears
    if not kernel.supports(runner.dtype):
        return f"gathered attention (the CPU kernel has no {runner.dtype})" + linears
    runner.compiled = kernel
    how = f"paged attention, CPU kernel ({kernel.seconds:.1f} s to load)"
    if runner.dtype == torch.bfloat16 and kernel.prefills:
        how += "; bf16 dot-product kernels for decode and prefill"
        if use_in_vision_tower(runner.model, kernel):
            how += " (and in the vision tower)"
    return how + linears
