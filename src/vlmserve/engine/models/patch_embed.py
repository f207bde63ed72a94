"""A vision tower's patch embedding as one matrix multiply instead of a 3-D convolution.

The Qwen families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) cut a picture into patches of
``temporal x patch x patch`` pixels in the processor and project each one with an
``nn.Conv3d`` whose stride equals its kernel: the kernel never slides, so the convolution is a
linear map of each flattened patch. torch runs it as a convolution all the same, and that is
slow on the CPU (mkldnn: 467 ms for a 1280x960 photo's 6,000 patches at Qwen2-VL-2B's 1,280
dimensions, against 122 ms as a matrix multiply) and, with some cuDNN versions and bfloat16,
very slow on GPUs. vLLM and SGLang compute it as a GEMM for that reason.

``linear_patch_embeds(model)`` turns every such ``nn.Conv3d`` of a loaded model into a
``PatchConv3d``: the same module with the same weight tensor (no copy, the state dict and
adapters unchanged), whose forward is ``F.linear`` over the flattened patches. The result
equals the convolution's up to float rounding (the sums run in another order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PatchConv3d", "linear_patch_embeds"]


class PatchConv3d(nn.Conv3d):
    """An ``nn.Conv3d`` with ``stride == kernel_size``, no padding, dilation or groups,
    computed as ``F.linear`` over non-overlapping patches (the remainder a convolution would
    not reach is dropped as it drops it)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() != 5:
            return super().forward(input)
        kt, kh, kw = self.kernel_size
        batch, _, frames, height, width = input.shape
        t, h, w = frames // kt, height // kh, width // kw
        weight = self.weight.reshape(self.out_channels, -1)  # [out, channels * kt * kh * kw]
        if (frames, height, width) == (kt, kh, kw):  # one patch per row: how the towers call it
            out = F.linear(input.reshape(batch, -1), weight, self.bias)
            return out.view(batch, self.out_channels, 1, 1, 1)
        patches = input.unfold(2, kt, kt).unfold(3, kh, kh).unfold(4, kw, kw)
        rows = patches.permute(0, 2, 3, 4, 1, 5, 6, 7).reshape(-1, weight.shape[1])
        out = F.linear(rows, weight, self.bias)
        return out.view(batch, t, h, w, self.out_channels).permute(0, 4, 1, 2, 3)


def _linear_equivalent(module: nn.Module) -> bool:
    return (
        type(module) is nn.Conv3d
        and module.stride == module.kernel_size
        and module.padding == (0, 0, 0)
        and module.dilation == (1, 1, 1)
        and module.groups == 1
        and module.padding_mode == "zeros"
    )


def linear_patch_embeds(model: nn.Module) -> int:
    """Make every non-sliding ``nn.Conv3d`` of ``model`` a ``PatchConv3d``; -> how many."""
    changed = 0
    for module in model.modules():
        if _linear_equivalent(module):
            module.__class__ = PatchConv3d
            changed += 1
    return changed
