"""Warm-up: a freshly loaded chat model answers a text and an image request of its own
before it counts as ready, so the first user does not pay lazy initialisation (the first
prefill and decode, the image processor, the vision tower, torch's thread team, ...).

Run by the manager after each load (start-up, on demand, reload) while it holds the model's
lock: ``/ready`` and ``/v1/models`` say not ready, and requests wait for it as for the load.
Proxied models and embedding models are not warmed (an upstream warms itself). Off with
``--no-warmup`` (``VLMSERVE_WARMUP=false``). A warm-up that fails is logged; the model
still serves (its requests will show the fault).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from vlmserve.engine.types import (
    ChatMessage,
    GenerateRequest,
    ImagePart,
    Part,
    SamplingParams,
    Serves,
    TextPart,
)

if TYPE_CHECKING:
    from PIL import Image

    from vlmserve.registry.handles import ModelHandle

__all__ = ["WARMUP_TOKENS", "load", "warm_up"]

log = logging.getLogger(__name__)
WARMUP_TOKENS = 8  # decode steps each warm-up request runs


async def load(handle: ModelHandle, warmup: bool) -> None:
    """Load the model, then (``warmup``) warm it up; it is not ``ready`` until both are done
    (the backend says READY from its loading thread before ``aload`` returns)."""
    handle.warming, handle.warmed = warmup, False
    try:
        await handle.backend.aload()
        if warmup:
            handle.warmed = await warm_up(handle) is not None
    finally:
        handle.warming = False


async def warm_up(handle: ModelHandle) -> float | None:
    """Run the warm-up requests of a loaded local chat model; their seconds (None: not
    warmed: a model of another kind, or a request failed)."""
    backend = handle.backend
    if backend.proxied or backend.serves is not Serves.CHAT:
        return None
    takes = backend.capabilities() or frozenset()
    kinds = ["text", "image"] if "vision" in takes else ["text"]
    started = time.perf_counter()
    try:
        for kind in kinds:
            await _answer(handle, kind)
    except Exception as exc:  # a broken model shows it on real requests too
        log.warning("model %s: its %s warm-up request failed: %s", handle.name, kind, exc)
        return None
    seconds = time.perf_counter() - started
    log.info(
        "model %s warmed up in %.2f s (%s request%s)",
        handle.name,
        seconds,
        " and ".join(kinds),
        "s" if len(kinds) > 1 else "",
    )
    return seconds


async def _answer(handle: ModelHandle, kind: str) -> None:
    parts: list[Part] = [TextPart("Describe this briefly.")]
    if kind == "image":
        parts.insert(0, ImagePart(_picture()))
    sampling = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    request = GenerateRequest(f"warmup-{kind}", [ChatMessage("user", parts)], sampling)
    prepared = await handle.backend.prepare(request)
    async for _ in handle.backend.generate(prepared):
        pass


def _picture() -> Image.Image:
    """A 224x224 gradient: a typical image's preprocessing and vision-tower path."""
    from PIL import Image

    image = Image.new("RGB", (224, 224))
    image.putdata([(x, y, (x + y) // 2) for y in range(224) for x in range(224)])
    return image
