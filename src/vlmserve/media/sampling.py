"""Which frames of a clip a model sees: each family's rule, as it was trained (no torch).

A rule is a ``VideoSampling`` value (frozen, picklable); ``pick_frames`` turns it, the clip's
frame count and rate, the server's cap (``VLMSERVE_MAX_VIDEO_FRAMES``) and a request's own
``FrameRequest`` into the source indices to decode:

- ``uniform``: ``n = min(total, cap)`` frames, the centre of each of ``n`` equal slices
  (LLaVA-OneVision's and InternVL's model cards, SmolVLM2's processor without sampling);
- ``qwen_vl_utils``: Qwen2-VL's and Qwen2.5-VL's ``smart_nframes`` (the authors' qwen-vl-utils,
  which vLLM follows): ``fps`` frames a second, at least ``min_frames``, at most
  ``max_frames``, a multiple of ``factor``, at indices ``linspace(0, total - 1, n).round()``;
- ``processor_fps``: a transformers video processor's own ``sample_frames`` (Qwen3-VL's):
  ``int(total / clip_fps * fps)`` frames within ``[min_frames, max_frames]``, same indices.

The cap bounds every rule; a request's ``num_frames`` replaces the count and its ``fps`` the
rate. Rounding is Python's (half to even), as numpy's and torch's ``round``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["QWEN_VL_UTILS", "UNIFORM", "FrameRequest", "VideoSampling", "pick_frames"]

_RULES = ("uniform", "qwen_vl_utils", "processor_fps")


@dataclass(frozen=True, slots=True)
class VideoSampling:
    """One family's frame rule (see the module docstring)."""

    rule: str = "uniform"
    fps: float | None = None  # frames a second to take (None: the rule's count only)
    min_frames: int = 1
    max_frames: int | None = None
    factor: int = 1  # the count is a multiple of this (Qwen's temporal patch)

    def __post_init__(self) -> None:
        if self.rule not in _RULES:
            raise ValueError(f"unknown video sampling rule {self.rule!r}; one of {_RULES}")

    def describe(self) -> str:
        """The rule in words (``/v1/models``, the README's family table)."""
        if self.rule == "uniform":
            return "uniform"
        top = f"-{self.max_frames}" if self.max_frames else "+"
        even = f", multiple of {self.factor}" if self.factor > 1 else ""
        return f"{self.fps:g} fps, {self.min_frames}{top} frames{even} ({self.rule})"


UNIFORM = VideoSampling()
# qwen-vl-utils' vision_process.py: FPS, FPS_MIN_FRAMES, FPS_MAX_FRAMES, FRAME_FACTOR
QWEN_VL_UTILS = VideoSampling("qwen_vl_utils", fps=2.0, min_frames=4, max_frames=768, factor=2)


@dataclass(frozen=True, slots=True)
class FrameRequest:
    """A request's own sampling (``media_io_kwargs.video`` / ``mm_processor_kwargs``)."""

    num_frames: int | None = None
    fps: float | None = None


def _linspace_round(total: int, n: int) -> list[int]:
    if n <= 1:
        return [0]
    step = (total - 1) / (n - 1)
    return [round(i * step) for i in range(n)]


def _centres(total: int, n: int) -> list[int]:
    return [(2 * i + 1) * total // (2 * n) for i in range(n)]


def _qwen_count(
    total: int, clip_fps: float | None, rule: VideoSampling, cap: int, ask: FrameRequest
) -> int:
    """qwen-vl-utils' ``smart_nframes`` with ``max_frames`` lowered to the cap."""
    factor = rule.factor
    hi = factor * (min(rule.max_frames or total, total, cap) // factor)
    if ask.num_frames is not None:
        n = factor * round(ask.num_frames / factor)
        return max(1, min(n, hi) if hi else min(total, cap))
    lo = factor * math.ceil(rule.min_frames / factor)
    fps = ask.fps or rule.fps or 2.0
    wanted = total / (clip_fps or 24.0) * fps  # qwen-vl-utils reads the clip's rate; 24 if unknown
    wanted = min(max(wanted, lo), hi, total)
    count = factor * math.floor(wanted / factor)
    return count if count >= 1 else max(1, min(total, cap))  # a clip shorter than one factor


def _processor_count(
    total: int, clip_fps: float | None, rule: VideoSampling, cap: int, ask: FrameRequest
) -> int:
    if ask.num_frames is not None:
        return min(ask.num_frames, total, cap)
    fps = ask.fps or rule.fps
    if fps is None:
        n = min(max(total, rule.min_frames), rule.max_frames or total)
    else:
        n = int(total / (clip_fps or 24.0) * fps)  # transformers assumes 24 fps when unknown
        n = min(max(n, rule.min_frames), rule.max_frames or total, total)
    return max(1, min(n, cap))


def pick_frames(
    total: int,
    clip_fps: float | None,
    rule: VideoSampling,
    cap: int,
    ask: FrameRequest | None = None,
) -> list[int]:
    """Source indices (ascending, distinct) of the frames to decode from a ``total``-frame
    clip at ``clip_fps`` frames a second; at most ``cap``."""
    ask = ask or FrameRequest()
    if total < 1:
        return []
    if rule.rule == "qwen_vl_utils":
        return _linspace_round(total, _qwen_count(total, clip_fps, rule, cap, ask))
    if rule.rule == "processor_fps":
        return _linspace_round(total, _processor_count(total, clip_fps, rule, cap, ask))
    if ask.fps is not None and ask.num_frames is None and clip_fps:
        ask = FrameRequest(num_frames=max(1, int(total / clip_fps * ask.fps)))
    n = min(total, cap, ask.num_frames or cap)
    return _centres(total, n)
