"""Numbers a client sends are finite; text is valid Unicode — else a 4xx, never a 500."""

from __future__ import annotations

import json

import pytest

from support import MODEL

BAD_NUMBERS = [
    b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,'
    b' "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":'
    b' {"type": "number", "maximum": 1e999}}}}',
]


@pytest.mark.parametrize("body", BAD_NUMBERS)
async def test_non_finite_numbers_are_refused_with_the_error_shape(client, body: bytes) -> None:
    r = await client.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert "finite" in r.json()["error"]["message"]


async def test_non_finite_numbers_are_refused_on_task_routes(client) -> None:
    body = b'{"text": "Ann met Bob", "schema": {"type": "object", "maxProperties": 1e999}}'
    r = await client.post(
        "/v1/extract/entities", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "stop": ["\udfff"]},
        ),
        ("/encode-text", {"text": "x\ud83d"}),
        ("/v1/extract/entities", {"text": "\udc00"}),
    ],
)
async def test_lone_surrogates_are_refused_naming_the_field(client, path: str, body: dict) -> None:
    raw = json.dumps(body)  # ASCII: the surrogate travels as a \\uXXXX escape, as clients send it
    r = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]


async def test_paired_surrogates_and_large_integers_still_work(client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "smile \U0001f600"}],
        "max_tokens": 2,
        "temperature": 0,
        "seed": 2**40,
    }
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
