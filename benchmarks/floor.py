"""The bandwidth floor of a decode step, shared by benchmarks/gpu.py and benchmarks/runner.py.

A decode step must read every weight the language model uses (all but the vision tower; a
tied embedding / LM head once) and every row's keys and values. Divided by the copy bandwidth
measured in the same process (same device, same threads), that is the time no step can beat.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["copy_bandwidth", "decode_weight_bytes", "kv_bytes_per_token", "sync"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int, repeats: int = 5) -> float:
    """Bytes/s moved by ``dst.copy_(src)`` of ``mib`` MiB (read + write), best of ``repeats``,
    with torch's current thread count on CPU."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - started)
    del src, dst
    return 2 * mib * 2**20 / best


def decode_weight_bytes(model: Any) -> tuple[int, int]:
    """(all weight bytes, bytes read per decode step: all but the vision tower's)."""
    params = list(model.named_parameters())  # tied embedding/lm_head counted once
    total = sum(p.numel() * p.element_size() for _, p in params)
    vision = sum(p.numel() * p.element_size() for n, p in params if ".visual." in f".{n}")
    return total, total - vision


def kv_bytes_per_token(config: Any, itemsize: int) -> int:
    """Keys and values of one token in every layer, from a (multimodal) model config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * itemsize
