"""Request fields that change the answer are served or a 400 naming them; no-ops are accepted;
unknown fields are accepted and logged, or a 400 under ``strict_fields``."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from support import MODEL


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
        "max_tokens": 4,
        **extra,
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_json", {"type": "object"}),
        ("guided_choice", ["a", "b"]),
        ("bad_words", ["x"]),
        ("prompt_logprobs", 1),
        ("echo", True),
        ("skip_special_tokens", False),
        ("add_generation_prompt", False),
        ("min_p", 0.1),
        ("reasoning_effort", "low"),
        ("modalities", ["text", "audio"]),
        ("functions", [{"name": "f"}]),
    ],
)
async def test_a_field_that_would_change_the_answer_is_a_400_naming_it(
    client: httpx.AsyncClient, field: str, value: Any
) -> None:
    r = await client.post("/v1/chat/completions", json=chat(**{field: value}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


async def test_no_ops_and_inert_values_are_accepted_and_unknown_fields_logged(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    plain = await client.post("/v1/chat/completions", json=chat())
    fields = {
        "user": "u1",
        "metadata": {"a": "b"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "prediction": None,
        "skip_special_tokens": True,
        "add_generation_prompt": True,
        "min_p": 0.0,
        "stop_token_ids": [],
        "modalities": ["text"],
        "guided_json": None,
        "frobnicate": 3,
    }
    with caplog.at_level(logging.WARNING):
        r = await client.post("/v1/chat/completions", json=chat(**fields))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    named = [rec.getMessage() for rec in caplog.records if "unknown fields" in rec.getMessage()]
    assert len(named) == 1 and "['frobnicate']" in named[0]


async def test_unknown_fields_are_a_400_under_strict_fields(make_client: Any) -> None:
    http = await make_client(strict_fields=True)
    r = await http.post("/v1/chat/completions", json=chat(frobnicate=3))
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    assert "VLMSERVE_STRICT_FIELDS" in r.json()["error"]["message"]
    ok = await http.post("/v1/chat/completions", json=chat(user="u", skip_special_tokens=True))
    assert ok.status_code == 200, ok.text  # known fields stay fine under strict
    r = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"


def with_message(**fields: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": "Hello", **fields}])


@pytest.mark.parametrize(
    ("field", "value"),
    [("audio", {"id": "audio_1"}), ("function_call", {"name": "f"}), ("refusal", "No.")],
)
async def test_a_message_field_that_would_change_the_answer_is_a_400_naming_it(
    client: httpx.AsyncClient, field: str, value: Any
) -> None:
    r = await client.post("/v1/chat/completions", json=with_message(**{field: value}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"messages[0].{field}"


async def test_message_no_ops_are_accepted_and_unknown_message_fields_logged(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """An earlier answer sent back as the SDK returned it (null refusal, audio, function
    call; empty annotations) is the same prompt; an unknown message field is named in the
    log."""
    plain = await client.post("/v1/chat/completions", json=chat())
    sdk = {"refusal": None, "audio": None, "function_call": None, "annotations": []}
    with caplog.at_level(logging.WARNING):
        r = await client.post("/v1/chat/completions", json=with_message(**sdk, colour="red"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    named = [rec.getMessage() for rec in caplog.records if "unknown fields" in rec.getMessage()]
    assert len(named) == 1 and "messages[0].colour" in named[0]


async def test_unknown_message_fields_are_a_400_under_strict_fields(make_client: Any) -> None:
    http = await make_client(strict_fields=True)
    r = await http.post("/v1/chat/completions", json=with_message(colour="red"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].colour"
    ok = await http.post("/v1/chat/completions", json=with_message(annotations=[]))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning", {"effort": "high"}),
        ("truncation", "auto"),
        ("include", ["x"]),
        ("top_logprobs", 3),
        ("prompt", {"id": "p"}),
    ],
)
async def test_responses_refuse_fields_that_would_change_the_answer(
    client: httpx.AsyncClient, field: str, value: Any
) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, field: value}
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


async def test_responses_accept_no_ops_and_inert_values(client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "input": "Hi",
        "max_output_tokens": 4,
        "truncation": "disabled",
        "service_tier": "auto",
        "safety_identifier": "s",
        "include": [],
        "input_image_detail": None,
    }
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text


async def test_verbosity_other_than_medium_is_a_400_on_both_endpoints(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/chat/completions", json=chat(verbosity="low"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "verbosity"
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
    r = await client.post("/v1/responses", json={**body, "text": {"verbosity": "high"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.verbosity"
    ok = await client.post("/v1/responses", json={**body, "text": {"verbosity": "medium"}})
    assert ok.status_code == 200, ok.text


async def test_responses_items_accept_output_fields_and_name_unknown_ones(make_client: Any) -> None:
    http = await make_client(strict_fields=True)
    item = {"role": "user", "content": "Hi", "id": "msg_1", "status": "completed"}
    body = {"model": MODEL, "input": [item], "max_output_tokens": 4}
    ok = await http.post("/v1/responses", json=body)
    assert ok.status_code == 200, ok.text
    r = await http.post("/v1/responses", json={**body, "input": [{**item, "colour": "red"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].colour", r.text
