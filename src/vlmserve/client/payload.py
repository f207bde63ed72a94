"""Request bodies for the load tester: random-word prompts plus optional noise image / video.

Bodies are all built before the clock starts, so encoding media never stalls the event loop
mid-run. Shared media (the default) is one string object referenced by every body.
"""

from __future__ import annotations

import random
from typing import Any

from vlmserve.client.media import data_url, noise_mp4, noise_png

__all__ = ["VIDEO_SIZE", "WORDS", "build_bodies", "prompt_text"]

VIDEO_SIZE = (64, 64)  # width, height of --video frames
_PROSE = (
    "image river mountain city street window light shadow colour red green blue yellow "
    "people animal dog cat bird tree flower sky cloud sun night morning water boat car "
    "road bridge house door table chair book paper letter sign text number face hand "
    "smile dark bright small large old new near far left right above below inside outside "
    "describe explain count list name find read show tell"
)
WORDS = tuple(_PROSE.split())


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _media_parts(
    image: tuple[int, int] | None, frames: int | None, seed: int
) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if image is not None:
        url = data_url(noise_png(image[0], image[1], seed), "image/png")
        parts.append({"type": "image_url", "image_url": {"url": url}})
    if frames is not None:
        url = data_url(noise_mp4(frames, *VIDEO_SIZE, seed=seed), "video/mp4")
        parts.append({"type": "video_url", "video_url": {"url": url}})
    return parts


def build_bodies(
    *,
    model: str,
    requests: int,
    max_tokens: int,
    prompt_words: int,
    ignore_eos: bool,
    seed: int,
    image: tuple[int, int] | None = None,
    video_frames: int | None = None,
    distinct_media: bool = False,
) -> list[dict[str, Any]]:
    """``requests`` streaming chat bodies; prompts differ per request, media only if distinct."""
    rng = random.Random(seed)
    shared = None if distinct_media else _media_parts(image, video_frames, seed)
    bodies = []
    for i in range(requests):
        media = shared if shared is not None else _media_parts(image, video_frames, seed + i + 1)
        text = {"type": "text", "text": prompt_text(rng, prompt_words)}
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
