"""decode_video / load_video on small clips made here with PyAV."""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import av
import numpy as np
import pytest

from vlmserve.errors import InvalidRequest, MediaError, PayloadTooLarge
from vlmserve.media import MediaPolicy, decode_video, load_video
from vlmserve.media import video as video_module

POLICY = MediaPolicy()


def grey(index: int, total: int) -> int:
    """Brightness that encodes a frame's position in the clip."""
    return 20 + index * 200 // max(total - 1, 1)


def make_video(
    total: int,
    width: int = 64,
    height: int = 48,
    *,
    codec: str = "mpeg4",
    container: str = "mp4",
    rate: int = 25,
    options: dict[str, str] | None = None,
) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, options=options or {})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(total):
            pixels = np.full((height, width, 3), grey(i, total), np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def make_audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        for _ in range(5):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), "fltp", "mono")
            frame.sample_rate = 8000
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


@pytest.fixture(scope="module")
def clip300() -> bytes:
    return make_video(300)


def mean_brightness(frame: object) -> float:
    return float(np.asarray(frame).mean())


def test_short_clip_returns_every_frame() -> None:
    result = decode_video(make_video(10), POLICY)
    assert len(result.frames) == 10 and result.frame_indices == list(range(10))
    assert result.source_frames == 10 and result.fps == pytest.approx(25.0)
    assert all(f.mode == "RGB" and f.size == (64, 48) for f in result.frames)


def test_long_clip_is_sampled_uniformly(clip300: bytes) -> None:
    result = decode_video(clip300, POLICY)
    indices = result.frame_indices
    assert len(result.frames) == 32 and result.source_frames == 300
    assert indices == sorted(set(indices))
    assert indices[0] < 300 / 32 and indices[-1] > 300 - 300 / 32
    gaps = np.diff(indices)
    assert gaps.max() - gaps.min() <= 1
    assert result.fps == pytest.approx(25 * 32 / 300)
    for frame, index in zip(result.frames, indices, strict=True):  # the pixels match the index
        assert abs(mean_brightness(frame) - grey(index, 300)) < 8


@pytest.mark.parametrize(("num_frames", "expected"), [(8, 8), (1, 1), (100, 32), (None, 32)])
def test_num_frames_is_capped_by_the_policy(
    clip300: bytes, num_frames: int | None, expected: int
) -> None:
    assert len(decode_video(clip300, POLICY, num_frames=num_frames).frames) == expected


def test_num_frames_must_be_positive(clip300: bytes) -> None:
    with pytest.raises(InvalidRequest, match="num_frames"):
        decode_video(clip300, POLICY, num_frames=0)


def test_frames_are_downscaled_keeping_the_aspect_ratio() -> None:
    result = decode_video(make_video(4, 64, 48), MediaPolicy(video_frame_max_pixels=768))
    assert all(f.size == (32, 24) for f in result.frames)


def test_matroska_without_a_frame_count_uses_the_duration() -> None:
    result = decode_video(make_video(40, container="matroska"), MediaPolicy(max_video_frames=4))
    assert result.source_frames == 40 and result.frame_indices == [5, 15, 25, 35]


def test_frames_are_counted_when_the_header_says_nothing(
    monkeypatch: pytest.MonkeyPatch, clip300: bytes
) -> None:
    monkeypatch.setattr(video_module, "_estimated_frames", lambda stream, container: None)
    result = decode_video(clip300, MediaPolicy(max_video_frames=3))
    assert result.source_frames == 300 and result.frame_indices == [50, 150, 250]


def test_fewer_frames_than_estimated_returns_what_was_sampled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(video_module, "_estimated_frames", lambda stream, container: 1000)
    result = decode_video(make_video(100), MediaPolicy(max_video_frames=10))
    assert result.frame_indices == [50] and result.source_frames == 100


def test_decode_bound_refuses_long_videos(monkeypatch: pytest.MonkeyPatch, clip300: bytes) -> None:
    policy = MediaPolicy(max_video_decode_frames=100)
    with pytest.raises(PayloadTooLarge, match="VLMSERVE_MAX_VIDEO_DECODE_FRAMES"):
        decode_video(clip300, policy)
    monkeypatch.setattr(video_module, "_estimated_frames", lambda stream, container: None)
    with pytest.raises(PayloadTooLarge, match="more than 100 frames"):
        decode_video(clip300, policy)


def test_8k_frames_are_refused_from_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_video(1, 7680, 4320, codec="libx264", options={"preset": "ultrafast"})

    def must_not_decode(*args: object) -> None:
        raise AssertionError("decoded a frame of an oversized video")

    monkeypatch.setattr(video_module, "_decode_targets", must_not_decode)
    started = time.perf_counter()
    with pytest.raises(PayloadTooLarge) as info:
        decode_video(data, POLICY)
    assert time.perf_counter() - started < 0.5
    assert info.value.message.startswith(
        "video frames are 7680x4320 pixels; the limit is 8294400 pixels per frame "
        "(VLMSERVE_MAX_VIDEO_PIXELS)"
    )


def test_3000_tiny_frames_sample_to_32_in_well_under_a_second() -> None:
    data = make_video(3000, 32, 32)
    started = time.perf_counter()
    result = decode_video(data, POLICY)
    assert time.perf_counter() - started < 1.0
    assert len(result.frames) == 32 and result.frame_indices[-1] > 2900


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b"\x00" * 1000, "not a readable video"),
        (b"#EXTM3U\n#EXTINF:10,\nhttp://127.0.0.1:9/a.ts\n#EXT-X-ENDLIST\n", "not a readable"),
        (b"ffconcat version 1.0\nfile /etc/passwd\n", "not a readable video"),
    ],
)
def test_garbage_and_playlists_are_media_errors(data: bytes, match: str) -> None:
    with pytest.raises(MediaError, match=match):
        decode_video(data, POLICY)


def test_truncated_file_is_a_media_error(clip300: bytes) -> None:
    for cut in (100, len(clip300) // 2, len(clip300) - 500):  # the index (moov) is at the end
        with pytest.raises(MediaError) as info:
            decode_video(clip300[:cut], POLICY)
        assert "Traceback" not in info.value.message and " at 0x" not in info.value.message


def test_truncated_streamable_file_returns_the_frames_it_has(tmp_path: Path) -> None:
    path = tmp_path / "faststart.mp4"  # index first, so a cut file still opens
    with (
        av.open(io.BytesIO(make_video(200))) as src,
        av.open(str(path), "w", options={"movflags": "faststart"}) as out,
    ):
        stream = out.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)
    data = path.read_bytes()
    result = decode_video(data[: len(data) // 2], POLICY)
    assert 1 <= len(result.frames) < 32
    assert result.source_frames < 200


def test_audio_only_file_has_no_video_stream() -> None:
    with pytest.raises(MediaError, match="no video stream"):
        decode_video(make_audio_only(), POLICY)


async def test_load_video_from_a_data_url() -> None:
    url = "data:video/mp4;base64," + base64.b64encode(make_video(12)).decode()
    result = await load_video(url, POLICY, num_frames=4)
    assert result.frame_indices == [1, 4, 7, 10]
    with pytest.raises(MediaError, match="expected video"):
        await load_video(url.replace("video/mp4", "image/png"), POLICY)
