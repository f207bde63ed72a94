"""The request mixes of benchmarks/serve.py, with every prompt and every medium distinct.

    short   today's acceptance prompt: 32 random words + a small noise PNG (``--image``)
    long    ~2,000 prompt tokens of random words, no media (1,500 words with Qwen2-VL's real
            tokenizer; the test checkpoints' small BPE needs ~2.7 tokens a word, so the
            word count is sized by the checkpoint's own tokenizer: ``words_for_tokens``)
    photo   one 1280x960 JPEG (a phone photo's size) + 32 words
    video   a 16-frame 448x448 MP4 at 2 fps + 32 words

Each request is seeded by ``(seed, workload, phase, level, round, index)``: the warm-up, every
concurrency level and every round send prompts and media no server has seen before, so no
prefix or media cache hit makes one server look faster than its prefill is. Within one
measurement every server gets the same bodies (same key), so they do the same work. Bodies are
built before the clock starts (encoding a video takes a while).
"""

from __future__ import annotations

import hashlib
import io
import random
from dataclasses import dataclass
from typing import Any

from vlmserve.client.payload import prompt_text
from vlmserve.media.encode import data_url

__all__ = [
    "WORKLOADS",
    "Workload",
    "build_bodies",
    "media_tokens",
    "request_seed",
    "words_for_tokens",
]


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    tokens: int | None = None  # text sized to this many tokens; None: ``--prompt-words`` words
    image: str | None = None  # "png": ``--image`` sized noise PNG; "photo": 1280x960 JPEG
    video_frames: int = 0


PHOTO_SIZE = (1280, 960)
VIDEO_SIZE = (448, 448)
VIDEO_FPS = 2
WORKLOADS = {
    "short": Workload("short", image="png"),
    "long": Workload("long", tokens=2000),
    "photo": Workload("photo", image="photo"),
    "video": Workload("video", video_frames=16),
}


def request_seed(*key: object) -> int:
    """A stable 63-bit seed for ``key`` (not Python's ``hash``, which varies per process)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _png(size: tuple[int, int], seed: int) -> str:
    from vlmserve.client.media import noise_png

    return data_url(noise_png(size[0], size[1], seed), "image/png")


def _jpeg(seed: int) -> str:
    from vlmserve.testing.media import gradient_image

    buf = io.BytesIO()
    gradient_image(*PHOTO_SIZE, seed=seed).save(buf, format="JPEG", quality=90)
    return data_url(buf.getvalue(), "image/jpeg")


def _mp4(frames: int, seed: int) -> str:
    from vlmserve.testing.media import mp4_bytes

    clip = mp4_bytes(frames, *VIDEO_SIZE, fps=VIDEO_FPS, seed=seed)
    return data_url(clip, "video/mp4")


def media_parts(workload: Workload, image: tuple[int, int] | None, seed: int) -> list[dict]:
    """The request's media content parts (none for ``long``; none for ``short`` without
    ``--image``)."""
    parts: list[dict[str, Any]] = []
    if workload.image == "png" and image is not None:
        parts.append({"type": "image_url", "image_url": {"url": _png(image, seed)}})
    elif workload.image == "photo":
        parts.append({"type": "image_url", "image_url": {"url": _jpeg(seed)}})
    if workload.video_frames:
        url = _mp4(workload.video_frames, seed)
        parts.append({"type": "video_url", "video_url": {"url": url}})
    return parts


def build_bodies(
    workload: Workload,
    key: tuple[object, ...],
    *,
    requests: int,
    model: str,
    max_tokens: int,
    prompt_words: int,
    image: tuple[int, int] | None,
    ignore_eos: bool,
) -> list[dict[str, Any]]:
    """``requests`` streaming chat bodies for ``workload`` with ``prompt_words`` words of text
    (for ``long``: ``words_for_tokens``); request ``i`` is seeded by
    ``request_seed(*key, i)`` (``key``: seed, phase, level, round), its text opens with that
    seed so no two share more than the chat template's opening tokens."""
    bodies = []
    for i in range(requests):
        seed = request_seed(workload.name, *key, i)
        words = prompt_text(random.Random(seed), prompt_words)
        text = {"type": "text", "text": f"Request {seed:016x}: {words}"}
        media = media_parts(workload, image, seed)
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": [*media, text] if media else text["text"]}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension: exactly max_tokens out, EOS or not
        bodies.append(body)
    return bodies


def words_for_tokens(model_dir: str, tokens: int) -> int:
    """Words of ``prompt_text`` that ``model_dir``'s tokenizer makes ~``tokens`` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sample = prompt_text(random.Random(0), 1000)
    per_word = len(tokenizer(sample)["input_ids"]) / 1000
    return max(1, round(tokens / per_word))


def media_tokens(model_dir: str, workload: Workload, image: tuple[int, int] | None) -> int:
    """Visual tokens one request of ``workload`` costs under ``model_dir``'s own processor
    (its pixel bounds), counted by running that processor on the same media the requests
    carry (decoded as a server decodes them)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    merge = int(getattr(processor.image_processor, "merge_size", 2)) ** 2
    count = 0
    for part in media_parts(workload, image, seed=0):
        if part["type"] == "image_url":
            out = processor.image_processor(images=[_decode_image(part)], return_tensors="pt")
            count += int(out["image_grid_thw"].prod()) // merge
        else:
            frames = _decode_frames(part)
            out = processor.video_processor(videos=[frames], return_tensors="pt")
            count += int(out["video_grid_thw"].prod()) // merge
    return count


def _payload(part: dict[str, Any]) -> bytes:
    import base64

    url = next(iter(v["url"] for k, v in part.items() if k != "type"))
    return base64.b64decode(url.split(",", 1)[1])


def _decode_image(part: dict[str, Any]) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(_payload(part))).convert("RGB")


def _decode_frames(part: dict[str, Any]) -> list[Any]:
    import av

    with av.open(io.BytesIO(_payload(part))) as container:
        return [frame.to_image() for frame in container.decode(video=0)]
