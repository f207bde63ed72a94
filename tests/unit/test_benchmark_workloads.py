"""benchmarks/serve.py's workloads (short, long, photo, video) and the medium checkpoint's
media bounds: every request new to the server, the media sized as the workloads promise, and
the visual tokens they cost under the real Qwen2-VL bounds."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import av
import pytest
from PIL import Image

from vlmserve.testing import TinySpec, medium_spec
from vlmserve.testing.media import gradient_image, mp4_bytes
from vlmserve.testing.tiny import media_processors

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from peers import workloads  # noqa: E402
from peers.workloads import WORKLOADS, build_bodies  # noqa: E402

sys.path.remove(str(BENCH))


def bodies(name: str, key: tuple[object, ...], n: int = 3, words: int = 8) -> list[dict]:
    return build_bodies(
        WORKLOADS[name],
        key,
        requests=n,
        model="m",
        max_tokens=4,
        prompt_words=words,
        image=(32, 32),
        ignore_eos=True,
    )


def parts(body: dict, kind: str) -> list[dict]:
    content = body["messages"][0]["content"]
    return [p for p in content if isinstance(content, list) and p["type"] == kind]


def payload(part: dict) -> bytes:
    url = next(v["url"] for k, v in part.items() if k != "type")
    return base64.b64decode(url.split(",", 1)[1])


def text(body: dict) -> str:
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else parts(body, "text")[0]["text"]


def test_every_request_differs_across_warmup_levels_rounds_and_indices() -> None:
    keys = [
        (0, "warmup", "vlmserve"),
        (0, "measure", 1, 0),
        (0, "measure", 8, 0),
        (0, "measure", 1, 1),
        (1, "measure", 1, 0),
    ]
    texts, images = [], []
    for key in keys:
        for body in bodies("short", key):
            texts.append(text(body))
            images.append(payload(parts(body, "image_url")[0]))
    assert len(set(texts)) == len(texts) == 15
    assert len(set(images)) == len(images)  # no media cache hit either
    # the same key gives the same bodies: every server of one measurement does the same work
    assert bodies("short", keys[1]) == bodies("short", keys[1])
    # and the text differs from the first word on, so prompts share only the chat template
    assert len({t.split()[1] for t in texts}) == len(texts)


def test_short_is_words_and_a_png_long_is_text_only() -> None:
    short = bodies("short", (0, "measure", 1, 0), words=32)[0]
    assert len(text(short).split()) == 2 + 32  # "Request <seed>:" then the words
    assert Image.open(io.BytesIO(payload(parts(short, "image_url")[0]))).size == (32, 32)
    long = bodies("long", (0, "measure", 1, 0), words=1500)[0]
    assert isinstance(long["messages"][0]["content"], str)
    assert len(text(long).split()) == 2 + 1500
    assert long["ignore_eos"] is True and long["stream_options"] == {"include_usage": True}


def test_photo_is_a_1280x960_jpeg_and_video_a_16_frame_448_clip_at_2_fps() -> None:
    photo = payload(parts(bodies("photo", (0, "m"), n=1)[0], "image_url")[0])
    image = Image.open(io.BytesIO(photo))
    assert (image.format, image.size) == ("JPEG", (1280, 960))
    clip = payload(parts(bodies("video", (0, "m"), n=1)[0], "video_url")[0])
    with av.open(io.BytesIO(clip)) as container:
        stream = container.streams.video[0]
        frames = [f.to_image() for f in container.decode(video=0)]
        assert float(stream.average_rate) == 2.0
    assert len(frames) == 16 and frames[0].size == (448, 448)
    other = payload(parts(bodies("video", (0, "n"), n=1)[0], "video_url")[0])
    assert other != clip


def test_long_is_sized_to_2000_tokens_by_the_checkpoints_tokenizer(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    words = workloads.words_for_tokens(str(tiny_dir), 2000)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    body = bodies("long", (0, "measure", 1, 0), n=1, words=words)[0]
    assert 1800 <= len(tokenizer(text(body))["input_ids"]) <= 2200


def test_media_tokens_runs_the_checkpoints_own_processor(tiny_dir: Path) -> None:
    """The tiny checkpoint keeps its small bounds: 28*28*64 pixels an image or a frame."""
    assert workloads.media_tokens(str(tiny_dir), WORKLOADS["photo"], None) == 54
    assert workloads.media_tokens(str(tiny_dir), WORKLOADS["video"], None) == 8 * 64
    assert workloads.media_tokens(str(tiny_dir), WORKLOADS["short"], (64, 64)) == 4
    assert workloads.media_tokens(str(tiny_dir), WORKLOADS["long"], (64, 64)) == 0


def visual_tokens(spec: TinySpec) -> tuple[int, int]:
    images, videos = media_processors(spec)
    photo = images(images=[gradient_image(1280, 960)], return_tensors="pt")
    frames = [gradient_image(448, 448, seed=i) for i in range(16)]
    clip = videos(videos=[frames], return_tensors="pt")
    return int(photo["image_grid_thw"].prod()) // 4, int(clip["video_grid_thw"].prod()) // 4


def test_the_medium_checkpoint_has_qwen2_vls_real_media_bounds_and_8k_positions() -> None:
    spec = medium_spec()
    assert (spec.min_pixels, spec.max_pixels) == (56 * 56, 28 * 28 * 1280)
    assert (spec.video_min_pixels, spec.video_max_pixels) == (28 * 28 * 128, 28 * 28 * 768)
    assert spec.max_position_embeddings >= 8192
    assert (spec.hidden_size, spec.num_hidden_layers, spec.torch_dtype) == (1024, 8, "bfloat16")
    photo, video = visual_tokens(spec)
    # 1280x960 scaled under 1280*28*28 pixels: 60 x 82 patches, merged 2x2
    assert photo == 30 * 41 == 1230
    assert video == 8 * 16 * 16 == 2048  # 16 frames in pairs, 448/28 = 16 tokens a side
    assert visual_tokens(TinySpec()) == (54, 512)  # the tiny bounds, which tests rely on


def test_unset_video_bounds_keep_the_tiny_checkpoints_cache_key() -> None:
    assert TinySpec().key() == "e47ab18b7964"  # the key before video bounds existed
    assert TinySpec(video_max_pixels=28 * 28 * 768).key() != TinySpec().key()


@pytest.mark.parametrize("seed", [0, 7])
def test_mp4_bytes_seed_changes_the_frames_and_seed_0_is_the_old_clip(seed: int) -> None:
    assert (mp4_bytes(2, 32, 32, seed=seed) == mp4_bytes(2, 32, 32)) == (seed == 0)
