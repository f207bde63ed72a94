"""The API process's share of warm-up: after the models answered their own warm-up requests
(``registry/warmup.py``, in the engine), a text and an image chat request per warmed model
go through this process's request path (wire model, media fetch and decode, conversion,
chat template and processor via ``tokenize``), so that the first user does not pay for
those first calls either. Nothing is generated: no answer, no usage, no metrics of a
generation. ``/ready`` waits for it (``ModelManager.starting``)."""

from __future__ import annotations

import io
import logging
import time
import uuid
from typing import Any

from vlmserve.api.common.convert import Converter
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.media.encode import data_url
from vlmserve.registry.manager import ModelManager

__all__ = ["warm_request_path"]

log = logging.getLogger(__name__)


async def warm_request_path(models: ModelManager, converter: Converter) -> None:
    """One text and one image request per model warmed in this start, through the
    conversion path; failures are logged (the model serves anyway)."""
    for handle in [h for h in models.handles if h.warmed and h.ready]:
        started = time.perf_counter()
        kinds = ["text", "image"] if "vision" in (handle.inputs or ()) else ["text"]
        try:
            for kind in kinds:
                body = ChatCompletionRequest(model=handle.name, messages=[_message(kind)])
                request = await converter.to_request(body, f"warmup-{uuid.uuid4().hex}")
                await handle.backend.tokenize(request)
        except Exception as exc:
            log.warning("model %s: the request path's warm-up failed: %s", handle.name, exc)
            continue
        log.info(
            "model %s: request path warmed up in %.2f s", handle.name, time.perf_counter() - started
        )


def _message(kind: str) -> Any:
    text = {"type": "text", "text": "Describe this briefly."}
    if kind == "text":
        return {"role": "user", "content": [text]}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png()}}, text]}


def _png() -> str:
    from PIL import Image

    image = Image.new("RGB", (96, 96))
    image.putdata([(x * 2, y * 2, 128) for y in range(96) for x in range(96)])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return data_url(out.getvalue(), "image/png")
