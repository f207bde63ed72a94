"""A bfloat16 vision tower's attention on the CPU prefill kernel (``cpu_prefill.c``).

The vision towers run as the model's own modules (``vision.py`` calls the family's
``get_image_features`` / ``get_video_features``), and they reach attention through
transformers' attention interface: ``config._attn_implementation`` names a function that
gets ``query``, ``key``, ``value`` as ``[batch, heads, tokens, head_dim]``. Qwen2-VL's tower
calls it once per frame or image (1,024 patches for a 448x448 video frame), bidirectional,
without a mask; there torch's CPU kernel computes in float32 and was half of the tower's
time on a 16-frame clip.

``use_in_vision_tower`` registers ``vlmserve_cpu_bf16`` -- the kernel where the call is one
sequence in bfloat16 without a mask, dropout or causality, torch's ``sdpa`` otherwise -- and
points the model's vision config at it. The language model is untouched: the runner does its
own attention.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlmserve.engine.models.cpu_attention import CpuPagedAttention

__all__ = ["NAME", "use_in_vision_tower"]

NAME = "vlmserve_cpu_bf16"
_kernel: CpuPagedAttention | None = None


def _attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    kernel = _kernel
    plain = attention_mask is None and not is_causal and not dropout and not kwargs
    if kernel is not None and plain and query.shape[0] == 1 and query.device.type == "cpu":
        dim = query.shape[-1]
        out = kernel.prefill(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            dim**-0.5 if scaling is None else scaling,
            causal=False,
        )
        if out is not None:
            return out[None], None  # [1, T, H, D], as the interface returns
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def use_in_vision_tower(model: torch.nn.Module, kernel: CpuPagedAttention) -> bool:
    """Point ``model``'s vision tower at the kernel where it applies: a bfloat16 model whose
    tower uses torch's ``sdpa`` and a build with the prefill kernel. -> whether it did."""
    global _kernel
    vision = getattr(model.config, "vision_config", None)
    if vision is None or not kernel.prefills or vision._attn_implementation != "sdpa":
        return False
    if getattr(model, "dtype", None) != torch.bfloat16:
        return False
    _kernel = kernel  # every instance loads the same library
    AttentionInterface.register(NAME, _attend)
    vision._attn_implementation = NAME
    return True
