"""response_format through /v1/chat/completions on the tiny random-weight Qwen2-VL.

A random-weight model is the worst case for constrained decoding: whatever it samples, the
answer must parse and validate, and finish with "stop" inside max_tokens.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from sse_client import iter_events, text_of
from support import MODEL

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
# Longest possible PERSON answer: ~12 + 3 + 1 + 5 + 3 * 8 + punctuation chars; every token is
# at least one character, so 96 tokens always suffice.
MAX_TOKENS = 96


def body(response_format: dict[str, Any], seed: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": MAX_TOKENS,
        "response_format": response_format,
        **extra,
    }


def person_format(schema: Any = PERSON) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


async def test_fifty_sampled_answers_parse_and_validate(client: httpx.AsyncClient) -> None:
    texts = set()
    for seed in range(50):
        r = await client.post("/v1/chat/completions", json=body(person_format(), seed))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (seed, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        texts.add(choice["message"]["content"])
    assert len(texts) > 40  # really sampled, not one fixed answer


async def test_streamed_answers_parse_and_validate(client: httpx.AsyncClient) -> None:
    for seed in range(8):
        r = await client.post("/v1/chat/completions", json=body(person_format(), seed, stream=True))
        assert r.status_code == 200, r.text
        events = list(iter_events(r))
        assert [e.finish_reason for e in events if e.finish_reason] == ["stop"]
        jsonschema.validate(json.loads(text_of(events)), PERSON)


async def test_stream_and_non_stream_give_the_same_answer(client: httpx.AsyncClient) -> None:
    full = await client.post("/v1/chat/completions", json=body(person_format(), 3))
    streamed = await client.post("/v1/chat/completions", json=body(person_format(), 3, stream=True))
    assert text_of(list(iter_events(streamed))) == full.json()["choices"][0]["message"]["content"]


async def test_json_object_answers_are_json_objects(client: httpx.AsyncClient) -> None:
    # Unbounded strings: a random model often runs to max_tokens, so several seeds are tried;
    # every answer that finishes must be a JSON object.
    finished = 0
    for seed in range(8):
        r = await client.post(
            "/v1/chat/completions", json=body({"type": "json_object"}, seed, max_tokens=256)
        )
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            finished += 1
            assert isinstance(json.loads(choice["message"]["content"]), dict), choice
        else:
            assert choice["finish_reason"] == "length", choice
    assert finished >= 2, f"only {finished} of 8 seeded json_object answers finished"


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "not"),
        ({"type": "string", "format": "iri"}, "iri"),
        ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf"),
    ],
)
async def test_unenforceable_schemas_are_a_400_naming_the_keyword(
    client: httpx.AsyncClient, schema: Any, keyword: str
) -> None:
    r = await client.post("/v1/chat/completions", json=body(person_format(schema), 0))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "unsupported_feature"
    assert keyword in error["message"]


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "string"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
    ],
)
async def test_malformed_response_formats_are_a_400(
    client: httpx.AsyncClient, response_format: Any
) -> None:
    r = await client.post("/v1/chat/completions", json=body(response_format, 0))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("response_format", [{"type": "yaml"}, "json"])
async def test_response_formats_of_the_wrong_shape_fail_wire_validation(
    client: httpx.AsyncClient, response_format: Any
) -> None:
    r = await client.post("/v1/chat/completions", json=body(response_format, 0))
    assert r.status_code == 400, r.text  # the API's request validation, before the engine
    assert r.json()["error"]["param"].startswith("response_format")
