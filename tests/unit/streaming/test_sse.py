"""SSE wire format: event encoding and Last-Event-ID parsing."""

from __future__ import annotations

import json

import pytest

from vlmserve.errors import InvalidRequest
from vlmserve.streaming import (
    Event,
    encode_comment,
    encode_event,
    error_emit,
    parse_event_id,
    validate_session_id,
)
from vlmserve.streaming.sse import encode_data


def test_encode_event_writes_id_and_data_lines() -> None:
    assert encode_event("s1", Event(3, '{"a": 1}')) == b'id: s1:3\ndata: {"a": 1}\n\n'


def test_encode_event_writes_the_event_type_when_set() -> None:
    raw = encode_event("s1", Event(0, "{}", event="error"))
    assert raw == b"id: s1:0\nevent: error\ndata: {}\n\n"


def test_encode_event_splits_multiline_data_into_several_data_lines() -> None:
    raw = encode_event("s", Event(1, "a\nb\r\nc\rd"))
    assert raw == b"id: s:1\ndata: a\ndata: b\ndata: c\ndata: d\n\n"


def test_encode_event_never_sends_meta() -> None:
    raw = encode_event("s", Event(1, "x", meta={"secret": "token ids"}))
    assert b"secret" not in raw


def test_encode_data_writes_data_lines_only() -> None:
    assert encode_data(Event(3, '{"a": 1}')) == b'data: {"a": 1}\n\n'
    assert encode_data(Event(4, "[DONE]", terminal=True)) == b"data: [DONE]\n\n"


def test_encode_data_sends_an_error_event_as_its_payload_only() -> None:
    emit = error_emit("boom", "internal_error")
    raw = encode_data(Event(5, emit.data, event=emit.event))
    assert raw == b"data: " + emit.data.encode() + b"\n\n"  # no `event: error` line


def test_encode_data_splits_multiline_data_and_never_sends_meta() -> None:
    assert encode_data(Event(1, "a\nb", meta={"secret": 1})) == b"data: a\ndata: b\n\n"


def test_encode_comment_is_an_sse_comment() -> None:
    assert encode_comment("ping") == b": ping\n\n"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("abc:0", ("abc", 0)), ("a:b:c:41", ("a:b:c", 41)), (" chatcmpl-x:7 ", ("chatcmpl-x", 7))],
)
def test_parse_event_id_splits_on_the_last_colon(value: str, expected: tuple[str, int]) -> None:
    assert parse_event_id(value) == expected


@pytest.mark.parametrize(
    "value",
    ["", "abc", "abc:", ":3", "abc:-1", "abc:x1", "abc:1.5", "a b:1", "abc:١", "s:" + "9" * 30],
)
def test_parse_event_id_rejects_garbage_with_invalid_request(value: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_event_id(value)
    assert info.value.param == "Last-Event-ID"


@pytest.mark.parametrize("value", ["", "a b", "x\n", "é", "a" * 257])
def test_validate_session_id_rejects_ids_that_cannot_go_on_an_id_line(value: str) -> None:
    with pytest.raises(InvalidRequest):
        validate_session_id(value)


def test_error_emit_has_the_openai_error_shape() -> None:
    emit = error_emit("boom", "server_restart")
    assert emit.event == "error"
    assert json.loads(emit.data) == {
        "error": {
            "message": "boom",
            "type": "server_error",
            "param": None,
            "code": "server_restart",
        }
    }
