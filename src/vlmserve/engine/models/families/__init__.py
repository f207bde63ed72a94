"""One adapter module per model family (mlx-lm's registry by convention).

Each module exports ``MODEL_TYPES`` (the ``config.model_type`` values it serves),
``supports(model) -> bool`` (config details the runner depends on) and
``build(model, vision_cache) -> (runner, embedder)``. ``FAMILIES`` maps a model type to its
module; ``batching.architectures`` is the only caller.
"""

from __future__ import annotations

from types import ModuleType

from vlmserve.engine.models.families import (
    gemma3,
    idefics3,
    internvl,
    llava,
    llava_onevision,
    qwen2_vl,
    qwen3_vl,
)

__all__ = ["FAMILIES"]

_MODULES = (qwen2_vl, qwen3_vl, llava, llava_onevision, idefics3, internvl, gemma3)
FAMILIES: dict[str, ModuleType] = {
    model_type: module for module in _MODULES for model_type in module.MODEL_TYPES
}
