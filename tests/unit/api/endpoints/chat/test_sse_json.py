"""A chunk's JSON is one line for every SSE reader, whatever text the model produced."""

from __future__ import annotations

import json

import httpx
import pytest

from vlmserve.api.endpoints.chat.objects import CompletionIds, chunk_json
from vlmserve.streaming.events import Event
from vlmserve.streaming.sse import encode_event

IDS = CompletionIds(id="chatcmpl-1", created=1, model="tiny")


@pytest.mark.parametrize("text", ["a\u2028b", "a\u2029b", "a\x85b", "a\x1cb\x0bc", "é\U0001f600"])
async def test_model_text_with_unicode_line_separators_stays_one_event(text: str) -> None:
    data = chunk_json(IDS, {"content": text})
    body = encode_event("s1", Event(index=0, data=data)) + b"data: [DONE]\n\n"
    response = httpx.Response(200, content=body)
    lines = [line async for line in response.aiter_lines()]  # splits like str.splitlines
    payloads = [line[6:] for line in lines if line.startswith("data: ")]
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == text
    assert payloads[1] == "[DONE]"
