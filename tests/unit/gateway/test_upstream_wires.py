"""The gateway's SSE reader on both wires an upstream may send: OpenAI's (``data:`` lines only:
vLLM, vlmserve by default) and the resumable one (``id:``/``event:`` lines: older vlmserve)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from vlmserve.engine.types import Chunk, FinishReason
from vlmserve.errors import VlmserveError
from vlmserve.gateway.upstream_wire import ChunkReader, UpstreamError, upstream_body

CHUNKS = [
    {"id": "chatcmpl-up", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"id": "chatcmpl-up", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
    {"id": "chatcmpl-up", "choices": [{"index": 0, "delta": {"content": "lo"}}]},
    {"id": "chatcmpl-up", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    {"id": "chatcmpl-up", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
]
ERROR = {"error": {"message": "boom", "type": "server_error", "param": None, "code": "x"}}


def openai_wire(payloads: list[str]) -> str:
    return "".join(f"data: {p}\n\n" for p in payloads)


def resumable_wire(payloads: list[str], events: dict[int, str] | None = None) -> str:
    out = []
    for i, p in enumerate(payloads):
        kind = f"event: {events[i]}\n" if events and i in events else ""
        out.append(f"id: up-1:{i}\n{kind}data: {p}\n\n")
    return "".join(out)


def read(text: str) -> tuple[ChunkReader, list[Chunk]]:
    reader = ChunkReader()
    return reader, [c for line in text.split("\n") for c in reader.feed(line)]


@pytest.mark.parametrize("wire", [openai_wire, resumable_wire])
def test_both_wires_give_the_same_chunks(wire: Callable[[list[str]], str]) -> None:
    reader, chunks = read(wire([json.dumps(c) for c in CHUNKS] + ["[DONE]"]))
    assert [c.text for c in chunks] == ["Hel", "lo", ""]
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (9, 2)
    assert reader.done and reader.upstream_id == "chatcmpl-up"


def test_an_error_as_data_is_raised_on_the_openai_wire() -> None:
    text = openai_wire([json.dumps(CHUNKS[1]), json.dumps(ERROR), "[DONE]"])
    with pytest.raises(VlmserveError, match="boom"):
        read(text)


def test_an_error_event_is_raised_on_the_resumable_wire() -> None:
    flat = json.dumps(ERROR["error"] | {"type": "invalid_request_error"})  # no "error" key
    text = resumable_wire([json.dumps(CHUNKS[1]), flat, "[DONE]"], events={1: "error"})
    with pytest.raises(UpstreamError, match="boom"):
        read(text)


def test_a_chunk_that_is_not_an_object_is_an_upstream_error() -> None:
    with pytest.raises(VlmserveError, match="non-object"):
        read(openai_wire(["[1, 2]"]))


def test_the_wire_choice_stays_at_the_gateway() -> None:
    raw = {"model": "m", "session_id": "s", "stream_options": {"resumable": True}}
    body = upstream_body(raw, "up")
    assert body["stream_options"] == {"include_usage": True} and "session_id" not in body
    assert raw["stream_options"] == {"resumable": True}  # the client's body is not changed
