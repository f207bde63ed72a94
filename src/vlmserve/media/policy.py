"""Limits and rules every media item is read under, and the decoded-video value object.

``MediaPolicy`` is a frozen value object built once from Settings and passed down; nothing in
``media`` reads the environment. Error messages name the setting that changes a limit; the names
live in ``SETTING`` so they are spelled the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vlmserve.errors import ConfigError

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["SETTING", "MediaPolicy", "VideoFrames"]

# Policy field -> the setting (environment variable) that controls it, quoted in error messages.
SETTING: dict[str, str] = {
    "max_bytes": "VLMSERVE_MAX_MEDIA_BYTES",
    "max_image_pixels": "VLMSERVE_MAX_IMAGE_PIXELS",
    "max_video_frames": "VLMSERVE_MAX_VIDEO_FRAMES",
    "max_video_pixels": "VLMSERVE_MAX_VIDEO_PIXELS",
    "max_video_decode_frames": "VLMSERVE_MAX_VIDEO_DECODE_FRAMES",
    "fetch_timeout": "VLMSERVE_MEDIA_FETCH_TIMEOUT",
    "max_redirects": "VLMSERVE_MEDIA_MAX_REDIRECTS",
    "allowed_local_roots": "VLMSERVE_ALLOWED_LOCAL_MEDIA_PATH",
    "allow_private_networks": "VLMSERVE_MEDIA_ALLOW_PRIVATE_NETWORKS",
    "image_formats": "VLMSERVE_MEDIA_IMAGE_FORMATS",
}

_POSITIVE = (
    "max_bytes",
    "max_image_pixels",
    "max_video_frames",
    "max_video_pixels",
    "video_frame_max_pixels",
    "max_video_decode_frames",
)


@dataclass(slots=True, frozen=True)
class MediaPolicy:
    max_bytes: int = 20 * 2**20  # per media item (decoded base64 or downloaded body)
    max_image_pixels: int = 4096 * 4096  # width*height, checked from the header before decoding
    max_video_frames: int = 32  # frames sampled per video, spread uniformly
    max_video_pixels: int = 3840 * 2160  # per-frame width*height, checked from the stream header
    video_frame_max_pixels: int = 768 * 768  # sampled frames are downscaled (aspect kept) to this
    max_video_decode_frames: int = 20000  # hard bound on frames decoded while sampling one video
    fetch_timeout: float = 10.0  # seconds for the whole fetch, redirects and body included
    max_redirects: int = 3
    allowed_local_roots: tuple[str, ...] = ()  # empty: local paths and file:// are refused
    allow_private_networks: bool = False  # True only for trusted internal deployments and tests
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise ConfigError(f"media policy: {name} must be at least 1")
        if self.fetch_timeout <= 0:
            raise ConfigError("media policy: fetch_timeout must be positive seconds")
        if self.max_redirects < 0:
            raise ConfigError("media policy: max_redirects must be 0 or more")


@dataclass(slots=True)
class VideoFrames:
    frames: list[Image.Image]  # RGB, in presentation order
    fps: float | None  # effective fps of the sampled frames (source fps * n_sampled / n_total)
    source_frames: int  # frames in the source as far as known
    frame_indices: list[int] = field(default_factory=list)  # source index of each kept frame
