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

import asyncio
import io
import json
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
    """POST one streamed chat completion to ``app`` in process (plain ASGI) and read it out."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "stream": True,
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if api_key:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    path = "/v1/chat/completions"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("warmup", 80),
    }
    answered, status = asyncio.Event(), []
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # no disconnect while the answer streams
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"the streamed warm-up request got HTTP {status}")


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
