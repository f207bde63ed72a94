"""Which models the batched engine serves, and the runner + prompt embedder for each.

The one place that maps a checkpoint's architecture to its batched implementation; the
engine asks ``build`` and never names a runner class. Architectures ``supports`` refuses
keep transformers' ``model.generate`` path (one request at a time, with a log line).
"""

from __future__ import annotations

from typing import Any

from vlmserve.engine.hf.batching.runner import Qwen2VLRunner
from vlmserve.engine.hf.batching.runner import supports as _qwen2_vl_supports
from vlmserve.engine.hf.batching.vision import PromptEmbedder
from vlmserve.engine.hf.batching.vision_cache import VisionCache

__all__ = ["build", "supports"]


def supports(model: Any) -> bool:
    """Whether the batched engine can serve this model (else one request at a time)."""
    return _qwen2_vl_supports(model)


def build(model: Any, vision_cache: VisionCache) -> tuple[Qwen2VLRunner, PromptEmbedder]:
    """The runner (prefill/decode over the paged KV cache) and the prompt embedder."""
    runner = Qwen2VLRunner(model)
    return runner, PromptEmbedder(model, runner, vision_cache)
