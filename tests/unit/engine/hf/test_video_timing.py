"""Video frames reach the processor with their real timing.

An 8-fps clip is sampled by ``vlmserve.media`` (4 of 8 frames: indices 1, 3, 5, 7) and sent
through ``build_inputs``. The processor inputs must equal what the same processor computes
when transformers' own PyAV reader takes those frames from the file (its ``VideoMetadata``):
Qwen2.5-VL's ``second_per_grid_ts``, Qwen3-VL's ``<t seconds>`` prompt timestamps, SmolVLM's
``Frame from MM:SS`` lines -- and no "Defaulting to fps" warning.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vlmserve.engine.hf import inputs
from vlmserve.engine.hf.inputs import build_inputs, frames_array, metadata_for, run_processor
from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    TextPart,
    VideoPart,
)
from vlmserve.media import MediaPolicy, VideoFrames, decode_video
from vlmserve.media.video import source_fps
from vlmserve.media.workers.shared import LentImage, release_block, write_block
from vlmserve.testing.families import FAMILIES
from vlmserve.testing.media import mp4_bytes

QUESTION = "What happens in this clip?"
TIMED = ["qwen2_5_vl", "qwen3_vl", "smolvlm"]
VIDEO = ["internvl", "llava_onevision", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "smolvlm"]


@cache
def processor(family: str) -> Any:
    from transformers import AutoProcessor

    if family == "smolvlm":
        pytest.importorskip("num2words", reason="SmolVLMProcessor needs num2words")
    return AutoProcessor.from_pretrained(FAMILIES[family]())


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("clip") / "eight-fps.mp4"
    path.write_bytes(mp4_bytes(frames=8, fps=8))
    return path


@pytest.fixture(scope="module")
def sampled(clip: Path) -> VideoFrames:
    return decode_video(clip.read_bytes(), MediaPolicy(), num_frames=4)


def as_part(video: VideoFrames) -> VideoPart:
    """What the API converter builds from a decoded clip."""
    return VideoPart(
        frames=video.frames,
        fps=source_fps(video),
        frame_indices=video.frame_indices,
        total_frames=video.source_frames,
    )


def ours(family: str, part: VideoPart) -> dict[str, Any]:
    message = ChatMessage("user", [part, TextPart(QUESTION)])
    request = GenerateRequest(request_id="t", messages=[message], sampling=SamplingParams())
    return build_inputs(processor(family), request).inputs


def reference(family: str, clip: Path, indices: list[int]) -> dict[str, Any]:
    """The processor on the same frames, read from the file by transformers itself."""
    from transformers.video_utils import load_video

    proc = processor(family)
    video, metadata = load_video(
        str(clip), backend="pyav", sample_indices_fn=lambda metadata, **_: np.array(indices)
    )
    content = [{"type": "video"}, {"type": "text", "text": QUESTION}]
    text = proc.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return dict(
        proc(
            text=[text],
            videos=[video],
            video_metadata=[metadata],
            do_sample_frames=False,
            return_tensors="pt",
        )
    )


@contextlib.contextmanager
def transformers_warnings() -> Iterator[list[str]]:
    """Messages transformers logs meanwhile (its logger does not propagate; once-only reset)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger("transformers")
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
    root.addHandler(handler)
    try:
        yield messages
    finally:
        root.removeHandler(handler)


def timestamps(family: str, input_ids: Any) -> list[str]:
    text = processor(family).tokenizer.decode(input_ids[0])
    return re.findall(r"<[\d.]+ seconds>|Frame from \d\d:\d\d|\d+:\d\d:\d\d", text)


def test_the_sampled_frames_sit_where_the_decoder_says(sampled: VideoFrames) -> None:
    assert sampled.frame_indices == [1, 3, 5, 7]
    assert sampled.source_frames == 8
    assert source_fps(sampled) == pytest.approx(8.0)


@pytest.mark.parametrize("family", TIMED)
def test_inputs_equal_the_processor_sampling_the_file_itself(
    family: str, clip: Path, sampled: VideoFrames
) -> None:
    got = ours(family, as_part(sampled))
    want = reference(family, clip, sampled.frame_indices)
    assert got["input_ids"].tolist() == want["input_ids"].tolist()  # prompt incl. timestamps
    pixels = "pixel_values_videos" if "pixel_values_videos" in want else "pixel_values"
    assert got[pixels].shape == want[pixels].shape
    assert float((got[pixels] - want[pixels]).abs().max()) == 0.0


@pytest.mark.parametrize("family", VIDEO)
def test_frames_in_shared_blocks_give_the_inputs_of_the_frames_themselves(
    family: str, sampled: VideoFrames, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frames go to the processor as one array, copied from their blocks: the same
    inputs as the frames given to the processor as PIL images."""
    blocks = [write_block(frame) for frame in sampled.frames]
    try:
        lent = as_part(sampled)
        lent.frames = [LentImage(block) for block in blocks]
        assert isinstance(frames_array(lent.frames), np.ndarray)
        got = ours(family, lent)
        monkeypatch.setattr(inputs, "frames_array", lambda frames: frames)
        want = ours(family, as_part(sampled))
    finally:
        for block in blocks:
            release_block(block.name)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert np.array_equal(np.asarray(got[key]), np.asarray(value)), key


def test_qwen2_5_vl_second_per_grid_ts_is_the_clips(sampled: VideoFrames, clip: Path) -> None:
    got = ours("qwen2_5_vl", as_part(sampled))["second_per_grid_ts"]
    want = reference("qwen2_5_vl", clip, sampled.frame_indices)["second_per_grid_ts"]
    # 4 of 8 frames at 8 fps: 4 frames/s sampled, 2 frames per temporal patch -> 0.5 s
    assert got.tolist() == pytest.approx(want.tolist())
    assert got.tolist() == pytest.approx([0.5])


def test_qwen3_vl_prompt_timestamps_are_the_clips(sampled: VideoFrames, clip: Path) -> None:
    got = ours("qwen3_vl", as_part(sampled))["input_ids"]
    want = reference("qwen3_vl", clip, sampled.frame_indices)["input_ids"]
    # frames at 1/8, 3/8 | 5/8, 7/8 s, averaged per temporal patch: 0.25 s and 0.75 s
    assert timestamps("qwen3_vl", got) == ["<0.2 seconds>", "<0.8 seconds>"]
    assert timestamps("qwen3_vl", got) == timestamps("qwen3_vl", want)


def test_smolvlm_prompt_has_the_clips_duration_and_frame_times(sampled: VideoFrames) -> None:
    found = timestamps("smolvlm", ours("smolvlm", as_part(sampled))["input_ids"])
    assert found == ["0:00:01"] + ["Frame from 00:00"] * 4  # 8 frames at 8 fps: one second


@pytest.mark.parametrize("family", TIMED)
def test_no_defaulting_to_fps_warning(family: str, sampled: VideoFrames) -> None:
    processor(family)  # loading may warn about other things
    with transformers_warnings() as warned:
        ours(family, as_part(sampled))
    assert not [m for m in warned if "Defaulting to" in m], warned


def test_the_warning_capture_sees_the_warning_without_metadata(sampled: VideoFrames) -> None:
    """Control: frames without timing make Qwen3-VL fall back to 24 fps, and say so."""
    proc = processor("qwen3_vl")
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}]}], tokenize=False
    )
    with transformers_warnings() as warned:
        run_processor(proc, [text], [], [sampled.frames])
    assert [m for m in warned if "Defaulting to `fps=24`" in m]


def test_metadata_of_frames_without_timing_is_consecutive_at_their_rate() -> None:
    frames = mp4_frames(3)
    meta = metadata_for(VideoPart(frames=frames, fps=2.0))
    assert meta.frames_indices == [0, 1, 2]
    assert (meta.total_num_frames, meta.fps, meta.duration) == (3, 2.0, 1.5)
    assert meta.timestamps == [0.0, 0.5, 1.0]
    assert metadata_for(VideoPart(frames=frames)).fps is None  # unknown stays unknown


def test_metadata_keeps_source_indices_and_clip_length() -> None:
    part = VideoPart(frames=mp4_frames(2), fps=25.0, frame_indices=[10, 40], total_frames=50)
    meta = metadata_for(part)
    assert meta.frames_indices == [10, 40]
    assert (meta.total_num_frames, meta.duration) == (50, 2.0)
    assert meta.timestamps == [0.4, 1.6]
    assert meta.sampled_fps == pytest.approx(1.0)


def mp4_frames(n: int) -> list[Any]:
    from vlmserve.testing.media import gradient_image

    return [gradient_image(32, 32, seed=i) for i in range(n)]
