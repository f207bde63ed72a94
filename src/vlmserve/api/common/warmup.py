"""The API process's share of warm-up: after the models answered their own warm-up requests
(``registry/warmup.py``, in the engine), a text and an image chat request per warmed model
go through this process's request path (wire model, media fetch and decode, conversion,
chat template and processor via ``tokenize``), then one short streamed chat completion
through the app itself (in process, ASGI: routing, the chat service, the stream session,
SSE), so that the first user does not pay for those first calls either (measured on the
tiny model: the first streamed request after ready took 2.4x the median of the next ones
without that last request, about 1x with it). That one request is served like any other:
it counts in ``/metrics``. ``/ready`` waits for all of it (``ModelManager.starting``)."""

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


async def warm_request_path(
    app: Any, models: ModelManager, converter: Converter, api_key: str | None
) -> None:
    """Per model warmed in this start: one text and one image request through the
    conversion path, then one streamed chat completion through ``app``; failures are
    logged (the model serves anyway)."""
    for handle in [h for h in models.handles if h.warmed and h.ready]:
        started = time.perf_counter()
        kinds = ["text", "image"] if "vision" in (handle.inputs or ()) else ["text"]
        try:
            for kind in kinds:
                body = ChatCompletionRequest(model=handle.name, messages=[_message(kind)])
                request = await converter.to_request(body, f"warmup-{uuid.uuid4().hex}")
                await handle.backend.tokenize(request)
            await _stream_once(app, handle.name, api_key)
        except Exception as exc:
            log.warning("model %s: the request path's warm-up failed: %s", handle.name, exc)
            continue
        log.info(
            "model %s: request path warmed up in %.2f s", handle.name, time.perf_counter() - started
        )


async def _stream_once(app: Any, model: str, api_key: str | None) -> None:
    import httpx  # the app's own client library; only at start-up

    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url="http://warmup")
    async with (
        client,
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        r.raise_for_status()
        async for _ in r.aiter_lines():
            pass


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
