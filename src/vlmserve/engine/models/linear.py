"""The runner's linear layers: fused, and on CPU float32 in oneDNN's packed weight layout.

A decode step is a handful of rows times every weight of the model: memory bound. MKL's
``sgemm`` on a plain ``[out, in]`` weight reads it at a fraction of the bandwidth for so
few rows (measured on this 2-core AVX2 CPU, a 5,632 x 1,024 float32 weight, 4 rows:
``F.linear`` 3.3 ms, the same product on the weight reordered once into oneDNN's blocked
layout 1.1 ms; 8 rows 3.4 vs 1.2 ms; 32 rows 4.8 vs 3.3 ms). The reorder is what
inductor's ``freezing`` does for CPU linears (``mkldnn._reorder_linear_weight`` +
``mkldnn._linear_pointwise``); here it is done once at load, without compiling anything.

Batch invariance (a row's result must not depend on its companions): with 4 or more rows
the packed product gives every row bit-identical results whatever the number of rows and
the row's place among them (checked for 4..1,500 rows at any offset); below 4 rows oneDNN
takes another path, so smaller batches are padded to 4 rows (as for ``F.linear``).

Memory: the packed weight replaces the plain one. The HF modules the runner walks (q/k/v,
o, gate/up, down) are swapped for ``_Slice`` modules reading the packed weight, so the
checkpoint is held once and ``model.generate`` still runs on the same weights (slower:
each slice computes the whole fused product; only tests and diagnostics call it on a
batched model). Elsewhere (CUDA, bfloat16 without oneDNN support, oneDNN missing) the
weights stay plain: fused storage, the HF parameters re-pointed at views of it.

bfloat16 on CPU: a step's decode rows go to ``cpu_linear.c`` (through
``CpuPagedAttention.linear``) where the build has AVX512-BF16. It reads a *plain* weight
at memory speed, 25-35% faster than oneDNN's packed product for 1-8 rows, and computes each
row alone (the same result in any batch). Weights are held once, so a bf16 weight waits
plain (``fuse(..., later=True)``) until the runner knows whether the kernel takes it
(``use_kernel``); one it does not take is packed then (``settle``). Prompt rows keep the
BLAS product: compute bound, where oneDNN's kernels are the faster ones.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MIN_ROWS", "PACK_MIN_ELEMENTS", "Linear", "ModuleLinear", "can_pack", "fuse"]

log = logging.getLogger(__name__)
MIN_ROWS = 4  # below this oneDNN/MKL switch to a GEMV path whose rounding differs
PACK_MIN_ELEMENTS = 1 << 19  # 2 MiB of float32: smaller weights stay plain (``can_pack``)


class Linear:
    """``y = x @ W.T + b`` for ``x: [rows, in]`` (any rows; fewer than 4 are padded)."""

    __slots__ = ("bias", "kernel", "out_features", "packed", "pending", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, out_features: int
    ):
        self.weight, self.bias, self.packed = weight, bias, packed
        self.out_features = out_features
        self.kernel: Any = None  # cpu_attention.CpuPagedAttention: its bf16 product (use_kernel)
        self.pending: tuple[nn.Module, list[str], list[int]] | None = None  # packed by settle

    def __call__(self, x: torch.Tensor, lead: int = 0) -> torch.Tensor:
        """``lead``: the first ``lead`` rows are decode rows (a step's running streams). With
        a kernel attached (``use_kernel``) those rows are its product, which gives a row the
        same result in any batch and reads the weight at memory speed; the others (prompt
        tokens) take the BLAS product."""
        if self.kernel is None or lead <= 0:
            return self._blas(x)
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = x.new_empty(rows, self.out_features) if lead >= rows else self._blas(x)
        lead = min(lead, rows)
        self.kernel.linear(x[:lead], self.weight, self.bias, out[:lead])
        return out

    def _blas(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= MIN_ROWS:
            return self._product(x)
        padded = torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])])
        return self._product(padded)[:rows]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def use_kernel(self, kernel: Any) -> bool:
        """Compute decode rows with ``kernel.linear`` (``cpu_linear.c``) where it takes this
        weight (plain bf16, ``in`` a multiple of 32) -> whether it does."""
        if self.packed or not kernel.takes_weight(self.weight):
            return False
        self.kernel, self.pending = kernel, None
        return True

    def settle(self) -> None:
        """Pack a weight ``fuse`` meant to pack (at once, or with ``later`` once no kernel
        took it); where oneDNN cannot, it stays plain."""
        if self.pending is None:
            return
        owner, names, rows = self.pending
        self.pending = None
        try:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, MIN_ROWS)
        except RuntimeError as exc:  # an unsupported shape or build: stay plain
            log.info("oneDNN weight packing unavailable (%s); using plain weights", exc)
            return
        self.packed = True
        _replace(owner, names, rows, self)  # the HF modules' views of the plain weight go

    def forward_any(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., in]`` (HF's modules pass [batch, tokens, in])."""
        flat = x.reshape(-1, x.shape[-1])
        return self(flat).view(*x.shape[:-1], self.out_features)


class ModuleLinear(Linear):
    """Linears that are not plain float weights (a quantized checkpoint's): each module is
    called as it is (its own kernel, e.g. torchao's int8 weight-only matmul) and the outputs
    concatenated; nothing is fused or repacked, the modules stay the model's own."""

    __slots__ = ("modules",)

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        out = sum(int(m.out_features) for m in modules)
        super().__init__(torch.empty(0), None, False, out)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.modules) == 1:
            return self.modules[0](x)
        return torch.cat([m(x) for m in self.modules], dim=-1)


def _plain(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose weight is an ordinary tensor (not a quantized subclass)."""
    weight = getattr(module, "weight", None)
    return type(module) is nn.Linear and type(weight.data) is torch.Tensor


class _Slice(nn.Module):
    """Stands in for one HF linear whose weight now lives, packed, in a fused ``Linear``."""

    def __init__(self, fused: Linear, start: int, stop: int, owns: bool):
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop
        if owns:  # the first slice holds the fused tensors: parameter counts and memory
            # figures (``model.parameters()``) still see the weights, once
            self.packed_weight = nn.Parameter(fused.weight, requires_grad=False)
            if fused.bias is not None:
                self.packed_bias = nn.Parameter(fused.bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.forward_any(x)[..., self.start : self.stop]


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing: CPU float32 (bfloat16 only where oneDNN has native kernels), for
    weights large enough to be read from memory: below ``PACK_MIN_ELEMENTS`` the packed
    call's fixed cost wins (measured, 1 thread: 256 x 128 with 8 rows 38 us packed vs 15 us
    plain; 1,024 x 1,024 294 vs 507 us)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.numel() < PACK_MIN_ELEMENTS:
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fuse(owner: nn.Module, names: list[str], *, pack: bool = True, later: bool = False) -> Linear:
    """One ``Linear`` for the linears ``owner.<name>`` (their outputs concatenated in order).

    Packed: the HF modules are replaced by ``_Slice`` views of it (the weights are held
    once, packed). Plain: the fused tensor is new storage and each HF parameter is
    re-pointed at its rows (also held once). ``later``: a weight that would be packed stays
    plain until ``settle`` (a kernel that reads plain weights may take it first)."""
    linears = [getattr(owner, name) for name in names]
    if not all(_plain(lin) for lin in linears):
        return ModuleLinear(linears)  # quantized (torchao, bitsandbytes, ...): their kernels
    weight = torch.cat([lin.weight.data for lin in linears], dim=0)
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.data for lin in linears], dim=0) if has_bias else None
    _repoint(linears, weight, bias)
    fused = Linear(weight, bias, False, weight.shape[0])
    if pack and can_pack(weight):
        fused.pending = (owner, names, [lin.weight.shape[0] for lin in linears])
        if not later:
            fused.settle()
    return fused


def _replace(owner: nn.Module, names: list[str], rows: list[int], fused: Linear) -> None:
    start = 0
    for name, n in zip(names, rows, strict=True):
        setattr(owner, name, _Slice(fused, start, start + n, owns=start == 0))
        start += n


def _repoint(linears: list[Any], weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[start : start + n]
        if bias is not None:
            lin.bias.data = bias[start : start + n]
        start += n
