"""Request fields that change the answer are served or a 400 naming them; no-ops are accepted;
unknown fields are accepted and logged, or a 400 under ``strict_fields``."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from support import MODEL
from vlmserve.testing.media import data_url, image_bytes


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
        "max_tokens": 4,
        **extra,
    }


def image(**ref: Any) -> dict[str, Any]:
    url = data_url(image_bytes(32, 32), "image/png")
    return chat(
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": url, **ref.pop("image_url", {})},
                        **ref,
                    },
                    {"type": "text", "text": "Describe."},
                ],
            }
        ]
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mm_processor_kwargs", {"max_pixels": 1000}),
        ("media_io_kwargs", {"video": {"num_frames": 4}}),
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


@pytest.mark.parametrize(
    ("part", "param"),
    [({"uuid": "img-1"}, "uuid"), ({"image_url": {"detail": "low"}}, "detail")],
)
async def test_media_options_not_served_are_400s(
    client: httpx.AsyncClient, part: dict[str, Any], param: str
) -> None:
    r = await client.post("/v1/chat/completions", json=image(**part))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("messages[0].content[0]")
    assert r.json()["error"]["param"].endswith(param)
    ok = await client.post("/v1/chat/completions", json=image(image_url={"detail": "auto"}))
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
