"""Test and demo support: tiny random-weight checkpoints of real architectures."""

from vlmserve.testing.tiny import (
    TinySpec,
    build_foreign_adapter,
    build_lora_adapter,
    build_qwen2_vl,
    cache_root,
)

__all__ = [
    "TinySpec",
    "build_foreign_adapter",
    "build_lora_adapter",
    "build_qwen2_vl",
    "cache_root",
]
