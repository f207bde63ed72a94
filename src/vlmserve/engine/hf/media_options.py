"""A request's media options as processor keyword arguments, by the model's family rules.

A pixel budget, ``mm_processor_kwargs``' ``min_pixels`` / ``max_pixels`` or the family's
budget for ``image_url.detail`` (``families/_media.py``), applies to the request's images, as
the image processor's ``size`` (``shortest_edge``, ``longest_edge``: pixels per image); the
one not given keeps the processor's default. A budget the family's processor does not have is
a 400, never dropped. The processor cache keys entries by the call's options, and the vision and
prefix caches by the processed pixels, so none of them mixes budgets.
"""

from __future__ import annotations

from typing import Any

from vlmserve.engine.models.families import media_rules
from vlmserve.engine.models.families._media import (
    MediaRules,
    detail_kwargs,
    pixel_budget,
    video_sampling,
)
from vlmserve.engine.types import MediaOptions
from vlmserve.errors import InvalidRequest
from vlmserve.media.sampling import VideoSampling

__all__ = ["family_media", "processor_kwargs"]


def family_media(model: Any, processor: Any) -> tuple[MediaRules, VideoSampling]:
    """The loaded model's family rules and its frame rule resolved on its processor."""
    rules = media_rules(str(getattr(model.config, "model_type", "")))
    return rules, video_sampling(rules, processor)


def processor_kwargs(rules: MediaRules, processor: Any, options: MediaOptions) -> dict[str, Any]:
    """Keyword arguments for the processor call (empty: its defaults)."""
    images = detail_kwargs(rules, processor, options.detail)
    asked = options.processor_kwargs
    if asked:
        budget = pixel_budget(processor) if rules.detail == "pixels" else None
        if budget is None:
            raise InvalidRequest(
                f"mm_processor_kwargs {', '.join(sorted(asked))}: this model's processor "
                f"({type(processor).__name__}) has no pixel budget; leave them out",
                param="mm_processor_kwargs",
            )
        low = asked.get("min_pixels", min(budget[0], asked.get("max_pixels", budget[0])))
        high = asked.get("max_pixels", max(budget[1], low))
        images = {"size": {"shortest_edge": low, "longest_edge": high}}
    return {"images_kwargs": images} if images else {}
