"""The decoder places every kept frame on the clip's timeline, as PyAV's stream reports it.

``VideoFrames.frame_indices`` and ``source_frames`` with ``source_fps()`` (the clip's own
rate, undone from the sampled ``fps``) are what ``VideoPart`` carries to the processor; they
must agree with what transformers' own PyAV reader records for the same file.
"""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest

from vlmserve.engine.types import VideoPart
from vlmserve.media import MediaPolicy, VideoFrames, decode_video
from vlmserve.media.video import source_fps
from vlmserve.testing.media import mp4_bytes

POLICY = MediaPolicy()


def clip(total: int, rate: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(total):
            pixels = np.full((32, 32, 3), i * 8, np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def test_eight_fps_clip_sampled_to_four_frames() -> None:
    video = decode_video(mp4_bytes(frames=8, fps=8), POLICY, num_frames=4)
    assert video.frame_indices == [1, 3, 5, 7]
    assert video.source_frames == 8
    assert video.fps == pytest.approx(4.0)  # the sampled frames' own rate
    assert source_fps(video) == pytest.approx(8.0)  # the clip's


@pytest.mark.parametrize(("total", "rate", "wanted"), [(10, 25, 4), (30, 30, 8), (7, 5, 7)])
def test_timing_matches_transformers_pyav_reader(
    tmp_path: Path, total: int, rate: int, wanted: int
) -> None:
    from transformers.video_utils import load_video

    data = clip(total, rate)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    video = decode_video(data, POLICY, num_frames=wanted)
    _, metadata = load_video(
        str(path),
        backend="pyav",
        sample_indices_fn=lambda metadata, **_: np.array(video.frame_indices),
    )
    assert video.source_frames == metadata.total_num_frames
    assert source_fps(video) == pytest.approx(metadata.fps, rel=1e-12)
    seconds = [i / source_fps(video) for i in video.frame_indices]
    assert seconds == pytest.approx(metadata.timestamps, rel=1e-12)


def test_no_rate_no_source_fps() -> None:
    assert source_fps(VideoFrames(frames=[], fps=None, source_frames=0)) is None
    assert source_fps(VideoFrames(frames=[object()], fps=None, source_frames=5)) is None  # type: ignore[list-item]


def test_video_part_timing_fields_default_to_unknown() -> None:
    part = VideoPart(frames=[])
    assert (part.fps, part.frame_indices, part.total_frames) == (None, None, None)
