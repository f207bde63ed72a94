"""A request's media options as processor keyword arguments, by the model's family rules.

``mm_processor_kwargs`` pixel budgets (``min_pixels``, ``max_pixels``) go to the processor as
sent (images and videos, as vLLM does); ``image_url.detail`` becomes the family's budget for
images only (``families/_media.py``). A budget the family's processor does not have is a 400,
never dropped. The processor cache keys entries by the call's options, and the vision and
prefix caches by the processed pixels, so none of them mixes budgets.
"""

from __future__ import annotations

from typing import Any

from vlmserve.engine.models.families import media_rules
from vlmserve.engine.models.families._media import MediaRules, detail_kwargs, video_sampling
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
    if options.processor_kwargs:
        if rules.detail != "pixels":
            names = ", ".join(sorted(options.processor_kwargs))
            raise InvalidRequest(
                f"mm_processor_kwargs {names}: this model's processor "
                f"({type(processor).__name__}) has no pixel budget; leave them out",
                param="mm_processor_kwargs",
            )
        return dict(options.processor_kwargs)
    images = detail_kwargs(rules, processor, options.detail)
    return {"images_kwargs": images} if images else {}
