"""Test and demo support: tiny random-weight checkpoints of real architectures.

``build_qwen2_vl`` and, per family, ``vlmserve.testing.families.FAMILIES`` (Qwen2.5-VL,
Qwen3-VL, LLaVA-1.5, LLaVA-OneVision, Idefics3, SmolVLM2, Gemma 3, InternVL3).
"""

from vlmserve.testing.families import FAMILIES, build_family
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
    "build_qwen2_vl",
    "cache_root",
]
