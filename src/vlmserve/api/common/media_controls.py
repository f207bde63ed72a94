"""A request's own media controls, checked against the server's caps before any fetch.

- ``mm_processor_kwargs`` (vLLM's): ``min_pixels``, ``max_pixels`` (the processor's pixel
  budget, where the model's processor has one: a 400 from the backend otherwise), ``fps``,
  ``num_frames`` (which frames of a video are decoded);
- ``media_io_kwargs`` (vLLM's): ``{"video": {"num_frames": N, "fps": F}}``;
- ``image_url.detail``: ``low``, ``high``, ``auto``, the family's pixel budgets; one per
  request (the processor takes one budget per call).

Caps: a pixel budget above ``VLMSERVE_MAX_IMAGE_PIXELS`` and a frame count above
``VLMSERVE_MAX_VIDEO_FRAMES`` are 400s that name the cap and its setting. Any other key is a
400 naming it: a control that changes the prompt is served or refused, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmserve.config import Settings
from vlmserve.engine.types import MediaOptions
from vlmserve.errors import InvalidRequest
from vlmserve.media.sampling import FrameRequest

__all__ = ["MediaControls", "media_controls"]

_PIXELS = ("min_pixels", "max_pixels")
_FRAMES = ("fps", "num_frames")
_MM = "mm_processor_kwargs"
_IO = "media_io_kwargs"


@dataclass(frozen=True, slots=True)
class MediaControls:
    options: MediaOptions = field(default_factory=MediaOptions)
    frames: FrameRequest = field(default_factory=FrameRequest)

    def key(self, kind: str, sampling: Any = None) -> str:
        """The options a media item of ``kind`` is processed with (``media_refs``)."""
        pixels = sorted(self.options.processor_kwargs.items())
        if kind == "image":
            return repr(("image", self.options.detail or "auto", pixels))
        return repr(("video", self.frames.num_frames, self.frames.fps, sampling, pixels))


def _number(where: str, value: Any, *, integer: bool) -> int | float:
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not value > 0:
        kind = "a positive integer" if integer else "a positive number"
        raise InvalidRequest(f"{where} must be {kind}, not {value!r}", param=where)
    return value


def _mapping(where: str, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    for key in value:
        if key not in allowed:
            raise InvalidRequest(
                f"{where}.{key} is not served; the keys served are {', '.join(allowed)}",
                param=f"{where}.{key}",
            )
    return value


def _pixels(mm: dict[str, Any], settings: Settings) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in _PIXELS:
        if mm.get(name) is None:
            continue
        value = int(_number(f"{_MM}.{name}", mm[name], integer=True))
        if value > settings.max_image_pixels:
            raise InvalidRequest(
                f"{_MM}.{name}={value} is above this server's cap of {settings.max_image_pixels} "
                "pixels (VLMSERVE_MAX_IMAGE_PIXELS)",
                param=f"{_MM}.{name}",
            )
        out[name] = value
    if out.get("min_pixels", 0) > out.get("max_pixels", settings.max_image_pixels):
        raise InvalidRequest(
            f"{_MM}.min_pixels is above {_MM}.max_pixels", param=f"{_MM}.min_pixels"
        )
    return out


def _one(name: str, mm: dict[str, Any], video: dict[str, Any]) -> tuple[str, Any]:
    """The value of ``name`` from either place (the same value if both give it)."""
    here, there = mm.get(name), video.get(name)
    if here is not None and there is not None and here != there:
        raise InvalidRequest(
            f"{_MM}.{name} and {_IO}.video.{name} differ; send one", param=f"{_IO}.video.{name}"
        )
    return (f"{_MM}.{name}", here) if here is not None else (f"{_IO}.video.{name}", there)


def _frames(mm: dict[str, Any], video: dict[str, Any], settings: Settings) -> FrameRequest:
    (n_where, n), (f_where, fps) = _one("num_frames", mm, video), _one("fps", mm, video)
    if n is not None and fps is not None:
        raise InvalidRequest("num_frames and fps are exclusive; send one", param=f_where)
    if n is not None:
        n = int(_number(n_where, n, integer=True))
        if n > settings.max_video_frames:
            raise InvalidRequest(
                f"{n_where}={n} is above this server's cap of {settings.max_video_frames} "
                "frames per video (VLMSERVE_MAX_VIDEO_FRAMES)",
                param=n_where,
            )
    if fps is not None:
        fps = float(_number(f_where, fps, integer=False))
    return FrameRequest(num_frames=n, fps=fps)


def _detail(details: list[str | None]) -> str | None:
    low = {d == "low" for d in details}
    if len(low) > 1:
        raise InvalidRequest(
            "detail 'low' must be on every image of a request or on none (the model's "
            "processor takes one pixel budget per request)",
            param="messages",
        )
    return "low" if low == {True} else (details[0] if details else None)


def media_controls(
    mm_processor_kwargs: Any, media_io_kwargs: Any, details: list[str | None], settings: Settings
) -> MediaControls:
    """The request's controls (400 for a key not served or a value above a cap)."""
    mm = _mapping(_MM, mm_processor_kwargs, _PIXELS + _FRAMES)
    io = _mapping(_IO, media_io_kwargs, ("video", "image"))
    video = _mapping(f"{_IO}.video", io.get("video"), _FRAMES)
    _mapping(f"{_IO}.image", io.get("image"), ())
    options = MediaOptions(processor_kwargs=_pixels(mm, settings), detail=_detail(details))
    return MediaControls(options=options, frames=_frames(mm, video, settings))
