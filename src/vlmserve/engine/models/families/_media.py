"""How a family takes media as it was trained: its video frame rule and what ``detail`` means.

Each family module exports ``MEDIA`` (a ``MediaRules``). ``video_sampling`` resolves the frame
rule against the loaded processor (Qwen3-VL's is its video processor's own ``fps``,
``min_frames`` and ``max_frames``); ``detail_kwargs`` maps ``image_url.detail`` to processor
keyword arguments:

- ``pixels`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``low`` is a budget of at most 256 merged
  patches (``256 * (patch * merge)**2`` pixels, 448x448 for Qwen2-VL) and never more than a
  quarter of the processor's default budget, so ``low`` always lowers the count;
- ``tiles`` (Idefics3, SmolVLM): ``low`` is the whole image as one tile (no splitting);
- ``crop`` (InternVL): ``low`` is the whole image as one tile (no crop into patches);
- ``fixed`` (LLaVA-1.5, LLaVA-OneVision, Gemma 3): one budget, whatever the detail.

``high`` and ``auto`` are the processor's defaults everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmserve.media.sampling import UNIFORM, VideoSampling

__all__ = ["DETAILS", "MediaRules", "detail_kwargs", "pixel_budget", "video_sampling"]

DETAILS = ("low", "high", "auto")
_LOW_TOKENS = 256  # merged patches in a `low` image (pixels families)


@dataclass(frozen=True, slots=True)
class MediaRules:
    video: VideoSampling = UNIFORM
    detail: str = "fixed"  # pixels | tiles | crop | fixed (see the module docstring)
    processor_sampling: bool = False  # the frame rule's numbers are the video processor's


def video_sampling(rules: MediaRules, processor: Any) -> VideoSampling:
    """The family's frame rule with the processor's own numbers where it has them."""
    if not rules.processor_sampling:
        return rules.video
    vp = getattr(processor, "video_processor", None)
    fps = getattr(vp, "fps", None) or rules.video.fps
    return VideoSampling(
        rules.video.rule,
        fps=float(fps) if fps else None,
        min_frames=int(getattr(vp, "min_frames", None) or rules.video.min_frames),
        max_frames=getattr(vp, "max_frames", None) or rules.video.max_frames,
        factor=rules.video.factor,
    )


def pixel_budget(processor: Any) -> tuple[int, int, int] | None:
    """(min pixels, max pixels, patch * merge) of a Qwen-style image processor."""
    ip = getattr(processor, "image_processor", None)
    size = getattr(ip, "size", None)
    lo, hi = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
    if lo is None or hi is None:
        return None
    factor = int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", 2))
    return int(lo), int(hi), factor


def detail_kwargs(rules: MediaRules, processor: Any, detail: str | None) -> dict[str, Any]:
    """Processor keyword arguments for ``detail`` (empty: the processor's defaults)."""
    if detail != "low" or rules.detail == "fixed":
        return {}
    if rules.detail == "tiles":
        return {"do_image_splitting": False}
    if rules.detail == "crop":
        return {"crop_to_patches": False}
    budget = pixel_budget(processor)
    if budget is None:
        return {}
    lo, hi, factor = budget
    top = max(factor * factor, min(_LOW_TOKENS * factor * factor, hi // 4))
    return {"size": {"shortest_edge": min(lo, top), "longest_edge": top}}
