"""Tiny quantized checkpoints: the tiny Qwen2-VL quantized by transformers' own quantizers.

``build_int8_qwen2_vl`` quantizes the language model's linears with torchao's int8
weight-only scheme (``TorchAoConfig(Int8WeightOnlyConfig())``, CPU and GPU) and saves the
checkpoint as transformers writes it (``quantization_config`` in config.json), so loading it
goes through the same quantizer path a user's torchao checkpoint takes.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from vlmserve.testing.tiny import TinySpec, build_qwen2_vl
from vlmserve.testing.tiny_cache import build_atomically, cache_root, short_hash

__all__ = ["build_int8_qwen2_vl"]


def build_int8_qwen2_vl(spec: TinySpec = TinySpec(), out_dir: Path | None = None) -> Path:
    """Build (or find in the cache) the int8 weight-only torchao copy of a tiny Qwen2-VL."""
    base = build_qwen2_vl(spec)
    key = short_hash({"base": base.name, "quant": "torchao-int8-weight-only"})
    target = Path(out_dir) if out_dir is not None else cache_root() / f"qwen2-vl-int8-{key}"
    return build_atomically(target, partial(_write, base), what=f"int8 tiny Qwen2-VL {key}")


def _write(base: Path, out: Path) -> None:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForImageTextToText, AutoProcessor, TorchAoConfig

    model = AutoModelForImageTextToText.from_pretrained(
        base,
        dtype=torch.float32,
        quantization_config=TorchAoConfig(quant_type=Int8WeightOnlyConfig()),
    )
    model.save_pretrained(out, safe_serialization=False)  # torchao tensors: torch pickles
    AutoProcessor.from_pretrained(base).save_pretrained(out)
