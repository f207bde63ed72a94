"""Sample frames from one video under the policy (PyAV, no torch).

Which frames are kept is the model family's rule (``media.sampling``: uniform by default, frame
``i`` the centre of the ``i``-th of ``n`` equal slices; Qwen's 2-fps rules), from the clip's
frame count and rate, under ``max_video_frames``. Decoding is
sequential (inter-frame codecs need every frame before a kept one) and stops right after the
last kept frame, so the cost is bounded by ``max_video_decode_frames``.

Timing: ``VideoFrames.fps`` is the rate of the *sampled* frames; ``source_fps()`` gives the
clip's own rate (PyAV's ``average_rate``, else ``guessed_rate``), which with ``frame_indices``
and ``source_frames`` places every kept frame on the clip's timeline
(``frame_indices[i] / source_fps`` seconds), as ``engine.types.VideoPart`` carries it.

Only a few demuxers are allowed (``format_whitelist``): playlist-style formats such as HLS or
ffconcat would make FFmpeg open other URLs or files named inside the data.
"""

from __future__ import annotations

import asyncio
import io
import math
from fractions import Fraction

import av
import httpx
from av.container import InputContainer
from av.video.frame import VideoFrame
from av.video.stream import VideoStream
from PIL import Image

from vlmserve.errors import InvalidRequest, MediaError, PayloadTooLarge, VlmserveError
from vlmserve.media.fetch import read_source
from vlmserve.media.netguard import Resolver
from vlmserve.media.policy import SETTING, MediaPolicy, VideoFrames
from vlmserve.media.sampling import UNIFORM, FrameRequest, VideoSampling, pick_frames

__all__ = ["decode_video", "load_video", "source_fps"]

_CONTAINERS = "mov,matroska,avi,mpegts,mpeg,flv,ogg,asf"
_CONTAINER_NAMES = "MP4/MOV, MKV/WebM, AVI, MPEG-TS/PS, FLV, Ogg or ASF"


def _open(data: bytes) -> InputContainer:
    try:
        return av.open(
            io.BytesIO(data),
            mode="r",
            container_options={"format_whitelist": _CONTAINERS},
            metadata_errors="ignore",
        )
    except (av.error.FFmpegError, OSError, ValueError, UnicodeError):
        raise MediaError(
            f"the data is not a readable video; send {_CONTAINER_NAMES} (the file may be "
            "truncated or corrupt)"
        ) from None


def _video_stream(container: InputContainer, policy: MediaPolicy) -> VideoStream:
    if not container.streams.video:
        raise MediaError("the file has no video stream (audio-only or data file?)")
    stream = container.streams.video[0]
    _check_size(stream.codec_context.width, stream.codec_context.height, policy)
    return stream


def _check_size(width: int, height: int, policy: MediaPolicy) -> None:
    if width * height > policy.max_video_pixels:
        raise PayloadTooLarge(
            f"video frames are {width}x{height} pixels; the limit is {policy.max_video_pixels} "
            f"pixels per frame ({SETTING['max_video_pixels']}); downscale the video before sending"
        )


def _estimated_frames(stream: VideoStream, container: InputContainer) -> int | None:
    """Frame count from the header, else duration * rate; None when neither is known."""
    if stream.frames > 0:
        return stream.frames
    rate = stream.average_rate or stream.guessed_rate
    if stream.duration and stream.time_base:
        seconds: Fraction | float | None = stream.duration * stream.time_base
    elif container.duration:
        seconds = container.duration / av.time_base
    else:
        seconds = None
    if rate and seconds:
        estimate = round(seconds * rate)
        return estimate if estimate > 0 else None
    return None


def _count_packets(container: InputContainer, stream: VideoStream, policy: MediaPolicy) -> int:
    """Frames counted by demuxing (one packet per frame), without decoding."""
    count = 0
    for packet in container.demux(stream):
        if packet.size:
            count += 1
        if count > policy.max_video_decode_frames:
            raise _too_many_frames(count, policy, at_least=True)
    return count


def _too_many_frames(total: int, policy: MediaPolicy, *, at_least: bool = False) -> PayloadTooLarge:
    amount = f"more than {total - 1}" if at_least else f"about {total}"
    return PayloadTooLarge(
        f"the video has {amount} frames; at most {policy.max_video_decode_frames} frames are "
        f"decoded per video ({SETTING['max_video_decode_frames']}); send a shorter clip"
    )


def _to_image(frame: VideoFrame, max_pixels: int) -> Image.Image:
    width, height = frame.width, frame.height
    if width * height > max_pixels:  # keep the aspect ratio; scale happens in swscale
        scale = math.sqrt(max_pixels / (width * height))
        width, height = max(1, int(width * scale)), max(1, int(height * scale))
    image: Image.Image = frame.reformat(width=width, height=height, format="rgb24").to_image()
    return image


def _decode_targets(
    container: InputContainer, stream: VideoStream, targets: list[int], policy: MediaPolicy
) -> tuple[list[Image.Image], list[int], int, bool]:
    """(kept frames, their indices, frames decoded, whether the stream ended early)."""
    wanted, last = set(targets), targets[-1]
    kept: list[Image.Image] = []
    indices: list[int] = []
    decoded = 0
    for index, frame in enumerate(container.decode(stream)):
        decoded = index + 1
        _check_size(frame.width, frame.height, policy)  # the header may lie or change mid-stream
        if index in wanted:
            kept.append(_to_image(frame, policy.video_frame_max_pixels))
            indices.append(index)
        if index >= last:
            return kept, indices, decoded, False
    return kept, indices, decoded, True


def _sample(
    data: bytes, policy: MediaPolicy, rule: VideoSampling, ask: FrameRequest
) -> VideoFrames:
    container = _open(data)
    try:
        stream = _video_stream(container, policy)
        total = _estimated_frames(stream, container)
        if total is None:
            total = _count_packets(container, stream, policy)
            container.close()
            container = _open(data)
            stream = _video_stream(container, policy)
        if total < 1:
            raise MediaError("the video has no frames")
        rate = stream.average_rate or stream.guessed_rate
        targets = pick_frames(
            total, float(rate) if rate else None, rule, policy.max_video_frames, ask
        )
        if targets[-1] >= policy.max_video_decode_frames:
            raise _too_many_frames(total, policy)
        stream.thread_type = "AUTO"
        kept, indices, decoded, ended = _decode_targets(container, stream, targets, policy)
    finally:
        container.close()
    if not kept:
        raise MediaError("the video has no decodable frames; it may be truncated or corrupt")
    source_frames = decoded if ended else max(total, decoded)
    fps = float(rate) * len(kept) / source_frames if rate else None
    return VideoFrames(frames=kept, fps=fps, source_frames=source_frames, frame_indices=indices)


def source_fps(video: VideoFrames) -> float | None:
    """The clip's own frame rate, undone from the sampled one (``fps * source_frames / n_kept``).

    This is ``VideoPart.fps`` for frames given with their ``frame_indices``; None when the
    stream declared no rate.
    """
    if video.fps is None or not video.frames or video.source_frames < 1:
        return None
    return video.fps * video.source_frames / len(video.frames)


def decode_video(
    data: bytes,
    policy: MediaPolicy,
    *,
    num_frames: int | None = None,
    sampling: VideoSampling = UNIFORM,
    fps: float | None = None,
) -> VideoFrames:
    """Bytes -> the RGB frames ``sampling`` picks (a family's rule; ``num_frames`` or ``fps``:
    the request's own), at most ``max_video_frames``."""
    if num_frames is not None and num_frames < 1:
        raise InvalidRequest("num_frames must be at least 1", param="num_frames")
    if fps is not None and not fps > 0:
        raise InvalidRequest("fps must be above 0", param="fps")
    if not data:
        raise MediaError("the video is empty")
    try:
        return _sample(data, policy, sampling, FrameRequest(num_frames=num_frames, fps=fps))
    except (VlmserveError, MemoryError):
        raise
    except Exception:  # hostile input: any demuxer/decoder failure is a fault in the client's data
        raise MediaError(
            "the video could not be decoded: it is truncated, corrupt or uses an unsupported codec"
        ) from None


async def load_video(
    source: str,
    policy: MediaPolicy,
    *,
    client: httpx.AsyncClient | None = None,
    resolver: Resolver | None = None,
    num_frames: int | None = None,
) -> VideoFrames:
    """Read ``source`` (URL, data: URL, base64 or allowed path) and sample it off the loop."""
    data = await read_source(source, policy, kind="video", client=client, resolver=resolver)
    return await asyncio.to_thread(decode_video, data, policy, num_frames=num_frames)
