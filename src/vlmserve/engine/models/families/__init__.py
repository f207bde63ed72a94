"""One adapter module per model family (mlx-lm's registry by convention).

Each module exports ``MODEL_TYPES`` (the ``config.model_type`` values it serves),
``supports(model) -> bool`` (config details the runner depends on) and
``build(model, vision_cache) -> (runner, embedder)``, and ``MEDIA`` (its video frame rule and
what ``image_url.detail`` means, ``_media.py``). ``FAMILIES`` maps a model type to its
module; ``batching.architectures`` builds runners from it, ``media_rules`` reads ``MEDIA``.
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
from vlmserve.engine.models.families._media import MediaRules

__all__ = ["FAMILIES", "media_rules"]

_MODULES = (qwen2_vl, qwen3_vl, llava, llava_onevision, idefics3, internvl, gemma3)
FAMILIES: dict[str, ModuleType] = {
    model_type: module for module in _MODULES for model_type in module.MODEL_TYPES
}


def media_rules(model_type: str) -> MediaRules:
    """The family's media rules; a model type outside the families gets uniform frames and
    one image budget."""
    module = FAMILIES.get(model_type)
    return module.MEDIA if module is not None else MediaRules()
