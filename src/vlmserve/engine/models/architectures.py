"""Which models the batched engine serves, and the runner + prompt embedder for each.

The one place that maps a checkpoint's architecture to its batched implementation; the
engine asks ``build`` and never names a runner class. Each family's adapter lives in
``families/`` (one module per family). Architectures ``supports`` refuses keep
transformers' ``model.generate`` path (one request at a time, with a log line).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vlmserve.engine.models.families import FAMILIES
from vlmserve.engine.models.vision import PromptEmbedder
from vlmserve.engine.models.vision_cache import VisionCache

__all__ = ["build", "supports"]


def _family(model: Any) -> ModuleType | None:
    config = getattr(model, "config", None)
    return FAMILIES.get(getattr(config, "model_type", None) or "")


def supports(model: Any) -> bool:
    """Whether the batched engine can serve this model (else one request at a time)."""
    family = _family(model)
    return family is not None and bool(family.supports(model))


def build(model: Any, vision_cache: VisionCache) -> tuple[Any, PromptEmbedder]:
    """The runner (prefill/decode over the paged KV cache) and the prompt embedder."""
    family = _family(model)
    if family is None or not family.supports(model):
        raise ValueError(f"no batched runner for {type(model).__name__}")
    runner, embedder = family.build(model, vision_cache)
    return runner, embedder
