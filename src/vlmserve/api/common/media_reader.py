"""Media parts of a chat request -> engine parts: fetched and decoded under the policy, by
the model's frame rule and the request's controls, or taken by ``uuid`` from ``MediaRefs``."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self

from PIL import Image

from vlmserve.api.common.media_controls import MediaControls, media_controls
from vlmserve.api.common.media_refs import MediaRefs
from vlmserve.api.endpoints.chat.protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    ImageUrlPart,
    InputImagePart,
    InputVideoPart,
    VideoUrlPart,
)
from vlmserve.api.metrics import Metrics
from vlmserve.config import Settings
from vlmserve.engine.types import ImagePart, Part, VideoPart
from vlmserve.errors import InvalidRequest
from vlmserve.media import MediaPolicy, VideoFrames, decode_image, decode_video, read_source
from vlmserve.media.fetch import MediaKind
from vlmserve.media.sampling import UNIFORM, FrameRequest, VideoSampling
from vlmserve.media.video import source_fps
from vlmserve.media.workers import MediaPool, current_lease, read_and_decode
from vlmserve.media.workers.budget import PIXEL_FACTOR
from vlmserve.media.workers.priority import low_priority_executor

__all__ = ["EMPTY_FRAMES", "MediaRead", "MediaReader", "controls", "media_policy", "sample_frames"]

EMPTY_FRAMES = "frames is empty; send at least one base64 JPEG frame"
MediaPartIn = ImageUrlPart | InputImagePart | VideoUrlPart | InputVideoPart


def sample_frames(frames: list[str], limit: int) -> list[str]:
    """Uniformly pick at most ``limit`` frames before any is decoded."""
    if len(frames) <= limit:
        return frames
    return [frames[(2 * i + 1) * len(frames) // (2 * limit)] for i in range(limit)]


def media_policy(settings: Settings) -> MediaPolicy:
    return MediaPolicy(
        max_bytes=settings.max_media_bytes,
        max_image_pixels=settings.max_image_pixels,
        max_video_frames=settings.max_video_frames,
        max_video_pixels=settings.max_video_pixels,
        max_video_decode_frames=settings.max_video_decode_frames,
        image_formats=tuple(f.upper() for f in settings.media_image_formats),
        fetch_timeout=settings.media_fetch_timeout,
        max_redirects=settings.media_max_redirects,
        allowed_local_roots=tuple(settings.allowed_local_media_path),
        allow_private_networks=settings.media_allow_private_networks,
    )


def _video_part(video: VideoFrames) -> VideoPart:
    """Decoded frames with their place on the clip's timeline (the processors that timestamp
    frames, Qwen2.5-VL/Qwen3-VL/SmolVLM, read it)."""
    if not video.frame_indices:
        return VideoPart(frames=video.frames, fps=video.fps)
    return VideoPart(
        frames=video.frames,
        fps=source_fps(video),
        frame_indices=list(video.frame_indices),
        total_frames=video.source_frames,
    )


def _pixel_bytes(decoded: object) -> int:
    """Bytes of the decoded pixels: one image, or a clip's frames."""
    frames = decoded.frames if isinstance(decoded, VideoFrames) else [decoded]
    return sum(len(f.getbands()) * f.width * f.height for f in frames if isinstance(f, Image.Image))


def _details(messages: list[ChatMessageIn]) -> list[str | None]:
    return [
        p.detail
        for m in messages
        for p in (m.content if isinstance(m.content, list) else [])
        if isinstance(p, ImageUrlPart | InputImagePart)
    ]


def controls(body: ChatCompletionRequest, settings: Settings) -> MediaControls:
    """The request's media controls, checked against the caps (``media_controls.py``)."""
    return media_controls(
        body.mm_processor_kwargs, body.media_io_kwargs, _details(body.messages), settings
    )


@dataclass(slots=True)
class MediaRead:
    """What one request's media parts are read with."""

    controls: MediaControls
    sampling: VideoSampling
    owner: str


@dataclass(slots=True)
class MediaReader:
    settings: Settings
    policy: MediaPolicy
    metrics: Metrics | None = None
    refs: MediaRefs | None = None  # media by uuid (None: not kept)
    pool: MediaPool | None = None  # media workers; None: decode on a thread of this process
    decoder: ThreadPoolExecutor | None = None  # those threads (media_worker_nice); None: asyncio's

    @classmethod
    def from_settings(
        cls, settings: Settings, metrics: Metrics | None = None, pool: MediaPool | None = None
    ) -> Self:
        refs = MediaRefs(
            getattr(settings, "media_uuid_ttl", 10.0) * 60,
            getattr(settings, "media_uuid_cache_bytes", 256 * 2**20),
        )
        policy = media_policy(settings)
        decoder = None
        if pool is None:  # without workers, decodes yield the cores to requests all the same
            threads = min(8, (os.cpu_count() or 1) + 4)
            nice = getattr(settings, "media_worker_nice", 0)
            decoder = low_priority_executor(threads, nice, "vlmserve-media-decode")
        return cls(settings, policy, metrics, refs, pool, decoder)

    async def _read_decode(
        self, kind: MediaKind, source: str, decode: Any, *args: Any, **kwargs: Any
    ) -> tuple[Any, int]:
        """``decode(data, *args, **kwargs)`` of the bytes ``source`` names, and their size: in
        a media worker (reading included) or, without workers, on a thread of this process.
        The decoded pixels are charged to the request's media memory lease."""
        started = time.perf_counter()
        if self.pool is not None:
            decoded, size = await self.pool.run(
                read_and_decode, source, self.policy, kind, decode, *args, **kwargs
            )
        else:
            data = await read_source(source, self.policy, kind=kind)
            context = contextvars.copy_context()  # as asyncio.to_thread
            call = functools.partial(context.run, decode, data, *args, **kwargs)
            loop = asyncio.get_running_loop()
            decoded, size = await loop.run_in_executor(self.decoder, call), len(data)
        lease = current_lease()
        if lease is not None:
            lease.grow(size + PIXEL_FACTOR * _pixel_bytes(decoded))
        if self.metrics is not None:
            self.metrics.observe_media_seconds(kind, time.perf_counter() - started)
        return decoded, size

    async def image(self, source: str) -> Image.Image:
        image, size = await self._read_decode("image", source, decode_image, self.policy)
        if self.metrics is not None:
            self.metrics.observe_media("image", size)
        return image  # type: ignore[no-any-return]

    async def frames(self, frames: list[str], num_frames: int | None = None) -> list[Image.Image]:
        """A clip sent as frames: uniformly sampled to the frame limit (or the request's
        ``num_frames``), then decoded."""
        if not frames:
            raise InvalidRequest(EMPTY_FRAMES, param="frames")
        picked = sample_frames(frames, min(num_frames or 2**31, self.settings.max_video_frames))
        return list(await asyncio.gather(*(self.image(f) for f in picked)))

    async def video(
        self, source: str, sampling: VideoSampling = UNIFORM, ask: FrameRequest | None = None
    ) -> VideoFrames:
        """A clip's frames by the model's rule (``sampling``) and the request's ``ask``."""
        ask = ask or FrameRequest()
        video, size = await self._read_decode(
            "video",
            source,
            decode_video,
            self.policy,
            num_frames=ask.num_frames,
            sampling=sampling,
            fps=ask.fps,
        )
        if self.metrics is not None:
            self.metrics.observe_media("video", size, frames=len(video.frames))
        return video  # type: ignore[no-any-return]

    async def _media_part(
        self,
        where: str,
        part: ImageUrlPart | InputImagePart | VideoUrlPart | InputVideoPart,
        media: MediaRead,
    ) -> Part:
        """A media part: decoded, or by its ``uuid`` alone (``media_refs.py``)."""
        is_image = isinstance(part, ImageUrlPart | InputImagePart)
        options = media.controls.key("image" if is_image else "video", media.sampling)
        if part.uuid is not None and not part.has_data and self.refs is not None:
            held = self.refs.get(media.owner, part.uuid, options, where)
            self._count_uuid("hit")
            return held
        out: Part
        if is_image:
            out = ImagePart(await self.image(part.source))
        elif isinstance(part, InputVideoPart) and part.frames is not None:
            out = VideoPart(frames=await self.frames(part.frames, media.controls.frames.num_frames))
        else:
            out = _video_part(await self.video(part.source, media.sampling, media.controls.frames))
        if part.uuid is not None and self.refs is not None:
            self.refs.put(media.owner, part.uuid, out, options)
            self._count_uuid("stored")
        return out

    def _count_uuid(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_media_uuid(result)
