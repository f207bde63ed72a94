"""Each family sees the frames it was trained on (``families/_media.py``, ``media.sampling``).

Qwen2-VL and Qwen2.5-VL: the authors' qwen-vl-utils rule, written out below from the
published ``vision_process.py`` (``smart_nframes`` and its ``linspace(...).round()``
indices); Qwen3-VL: its video processor's own 2-fps sampling, run by transformers on the
whole clip. The prompt built from our decoded frames must equal the processor's on the
reference frames, token for token and pixel for pixel.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest

from vlmserve.engine.hf.inputs import build_inputs
from vlmserve.engine.models.families import media_rules
from vlmserve.engine.models.families._media import video_sampling
from vlmserve.engine.types import ChatMessage, GenerateRequest, SamplingParams, TextPart, VideoPart
from vlmserve.media import MediaPolicy, VideoFrames, decode_video
from vlmserve.media.sampling import QWEN_VL_UTILS, UNIFORM, FrameRequest, pick_frames
from vlmserve.media.video import source_fps
from vlmserve.testing.families import FAMILIES
from vlmserve.testing.media import mp4_bytes

QUESTION = "What happens in this clip?"
# (frames, fps): 3 s -> 6 frames, 5 s -> 10, 16 s -> 32 (over a 16-frame cap), 1 s -> 4 (minimum)
CLIPS = [(30, 10), (40, 8), (64, 4), (12, 12)]


def qwen_vl_utils_indices(total: int, video_fps: float, max_frames: int | None = None) -> list[int]:
    """qwen-vl-utils' frame choice (vision_process.py: FPS=2, FRAME_FACTOR=2,
    FPS_MIN_FRAMES=4, FPS_MAX_FRAMES=768; ``max_frames``: its per-video option)."""
    factor = 2

    def ceil_by_factor(number: float, f: int) -> int:
        return math.ceil(number / f) * f

    def floor_by_factor(number: float, f: int) -> int:
        return math.floor(number / f) * f

    min_frames = ceil_by_factor(4, factor)
    top = max_frames if max_frames is not None else min(768, total)
    max_frames_ = floor_by_factor(top, factor)
    nframes = total / video_fps * 2.0
    nframes = min(min(max(nframes, min_frames), max_frames_), total)
    nframes = floor_by_factor(nframes, factor)
    assert factor <= nframes <= total
    return np.linspace(0, total - 1, nframes).round().astype(int).tolist()


def clip_file(tmp: Path, frames: int, fps: int) -> Path:
    path = tmp / f"clip-{frames}-{fps}.mp4"
    if not path.exists():
        path.write_bytes(mp4_bytes(frames=frames, fps=fps))
    return path


def clip_info(path: Path) -> tuple[int, float]:
    """(frames, fps) as a reader such as decord reports them."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return stream.frames, float(stream.average_rate)


@cache
def processor(family: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(FAMILIES[family]())


def as_part(video: VideoFrames) -> VideoPart:
    return VideoPart(
        frames=video.frames,
        fps=source_fps(video),
        frame_indices=video.frame_indices,
        total_frames=video.source_frames,
    )


def ours(family: str, path: Path, cap: int = 768) -> tuple[VideoFrames, dict[str, Any]]:
    proc = processor(family)
    rule = video_sampling(media_rules(family), proc)
    video = decode_video(path.read_bytes(), MediaPolicy(max_video_frames=cap), sampling=rule)
    message = ChatMessage("user", [as_part(video), TextPart(QUESTION)])
    request = GenerateRequest(request_id="t", messages=[message], sampling=SamplingParams())
    return video, build_inputs(proc, request).inputs


def the_processors(family: str, path: Path, indices: list[int] | None) -> dict[str, Any]:
    """The processor on frames transformers reads from the file: at ``indices``, or (None)
    all of them, sampled by the processor itself."""
    from transformers.video_utils import load_video

    proc = processor(family)
    pick = None if indices is None else (lambda metadata, **_: np.array(indices))
    video, metadata = load_video(str(path), backend="pyav", sample_indices_fn=pick)
    content = [{"type": "video"}, {"type": "text", "text": QUESTION}]
    text = proc.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    out = proc(
        text=[text],
        videos=[video],
        video_metadata=[metadata],
        do_sample_frames=indices is None,
        return_tensors="pt",
    )
    return dict(out)


def assert_same_inputs(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    assert got["video_grid_thw"].tolist() == want["video_grid_thw"].tolist()
    assert float((got["pixel_values_videos"] - want["pixel_values_videos"]).abs().max()) == 0.0


@pytest.mark.parametrize(("frames", "fps"), CLIPS)
def test_qwen_frames_are_qwen_vl_utils_choice(tmp_path: Path, frames: int, fps: int) -> None:
    path = clip_file(tmp_path, frames, fps)
    total, rate = clip_info(path)
    video = decode_video(
        path.read_bytes(), MediaPolicy(max_video_frames=768), sampling=QWEN_VL_UTILS
    )
    assert video.frame_indices == qwen_vl_utils_indices(total, rate)
    capped = decode_video(
        path.read_bytes(), MediaPolicy(max_video_frames=16), sampling=QWEN_VL_UTILS
    )
    assert capped.frame_indices == qwen_vl_utils_indices(total, rate, max_frames=16)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize(("frames", "fps"), CLIPS[:2])
def test_qwen2_vl_prompts_equal_qwen_vl_utils_frames(
    tmp_path: Path, family: str, frames: int, fps: int
) -> None:
    path = clip_file(tmp_path, frames, fps)
    video, got = ours(family, path)
    reference = qwen_vl_utils_indices(*clip_info(path))
    assert video.frame_indices == reference
    assert_same_inputs(got, the_processors(family, path, reference))


@pytest.mark.parametrize(("frames", "fps"), CLIPS[:3])
def test_qwen3_vl_prompt_equals_its_processor_sampling_the_clip(
    tmp_path: Path, frames: int, fps: int
) -> None:
    path = clip_file(tmp_path, frames, fps)
    _, got = ours("qwen3_vl", path)
    assert_same_inputs(got, the_processors("qwen3_vl", path, None))


def test_qwen3_vl_rule_is_read_from_its_processor() -> None:
    rule = video_sampling(media_rules("qwen3_vl"), processor("qwen3_vl"))
    assert (rule.rule, rule.fps, rule.min_frames, rule.max_frames) == ("processor_fps", 2.0, 4, 768)
    assert media_rules("llava_onevision").video == UNIFORM  # the model card's uniform frames


def test_the_cap_bounds_every_rule_and_a_request_sets_count_or_rate() -> None:
    for rule in (UNIFORM, QWEN_VL_UTILS, video_sampling(media_rules("qwen3_vl"), None)):
        assert len(pick_frames(3000, 30.0, rule, cap=8)) <= 8
    assert pick_frames(8, 8.0, UNIFORM, cap=4) == [1, 3, 5, 7]  # centres of equal slices
    assert len(pick_frames(80, 8.0, QWEN_VL_UTILS, 32, FrameRequest(num_frames=7))) == 8  # even
    assert len(pick_frames(80, 8.0, QWEN_VL_UTILS, 32, FrameRequest(fps=1.0))) == 10
    assert len(pick_frames(80, 8.0, UNIFORM, 32, FrameRequest(fps=0.5))) == 5
