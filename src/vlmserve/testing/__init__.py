"""Test and demo support: tiny random-weight checkpoints of real architectures.

``build_qwen2_vl`` and, per family, ``vlmserve.testing.families.FAMILIES`` (Qwen2.5-VL,
Qwen3-VL, LLaVA-1.5, LLaVA-OneVision, Idefics3, SmolVLM2, Gemma 3, InternVL3);
``build_medium``: the benchmarks' larger Qwen2-VL (~100M parameters, real media bounds).
"""

from vlmserve.testing.families import FAMILIES, build_family
from vlmserve.testing.medium import build_medium, medium_spec
from vlmserve.testing.tiny import (
    TinySpec,
    build_foreign_adapter,
    build_lora_adapter,
    build_qwen2_vl,
    cache_root,
)

__all__ = [
    "FAMILIES",
    "TinySpec",
    "build_family",
    "build_foreign_adapter",
    "build_lora_adapter",
    "build_medium",
    "build_qwen2_vl",
    "cache_root",
    "medium_spec",
]
