"""The media pipeline through the app: workers give the processor the same input as in-process
decoding (so the same greedy answer), the media memory budget answers 413 before parsing, and
a request whose media take too long is a 408."""

from __future__ import annotations

import io
import random
from typing import Any

import httpx
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from support import MODEL, make_settings
from vlmserve.api.common.convert import Converter
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.engine.hf.inputs import build_inputs
from vlmserve.media.workers import MediaPool
from vlmserve.testing.media import data_url, image_bytes, mp4_bytes


def _noise_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), random.Random(7).randbytes(width * height * 3)).save(
        buf, format="PNG"
    )
    return buf.getvalue()


def _body(max_tokens: int = 8) -> dict[str, Any]:
    photo = data_url(image_bytes(200, 150, fmt="JPEG", seed=5), "image/jpeg")
    clip = data_url(mp4_bytes(frames=6, seed=2), "video/mp4")
    content = [
        {"type": "image_url", "image_url": {"url": photo}},
        {"type": "video_url", "video_url": {"url": clip}},
        {"type": "text", "text": "Describe both."},
    ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def test_processor_output_is_bit_identical_with_two_media_workers(tiny_dir: Any) -> None:
    settings = make_settings(tiny_dir)
    processor = AutoProcessor.from_pretrained(str(tiny_dir))
    body = ChatCompletionRequest.model_validate(_body())
    pool = MediaPool(2, nice=0)
    try:
        pooled = await Converter.from_settings(settings, pool=pool).to_request(body, "a")
    finally:
        pool.close()
    local = await Converter.from_settings(settings).to_request(body, "b")
    a, b = build_inputs(processor, pooled).inputs, build_inputs(processor, local).inputs
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


async def test_greedy_answers_with_two_media_workers_equal_those_with_none(
    make_client: Any,
) -> None:
    answers = []
    for workers in (2, 0):
        client: httpx.AsyncClient = await make_client(media_workers=workers)
        answer = await client.post("/v1/chat/completions", json=_body(), timeout=120)
        assert answer.status_code == 200, answer.text
        answers.append(answer.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]


async def test_a_body_larger_than_the_media_memory_is_413_naming_the_setting(
    make_client: Any,
) -> None:
    client = await make_client(media_memory=100_000)
    body = _body()
    big = data_url(_noise_png(200, 200), "image/png")  # ~160 KB of base64
    body["messages"][0]["content"][0]["image_url"]["url"] = big
    answer = await client.post("/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert "VLMSERVE_MEDIA_MEMORY" in error["message"] and error["code"] == "media_memory_exceeded"
    text = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=text)).status_code == 200


@pytest.mark.parametrize("workers", [0, 1])
async def test_media_over_the_media_timeout_is_a_408(make_client: Any, workers: int) -> None:
    client = await make_client(media_timeout=0.001, media_workers=workers)
    answer = await client.post("/v1/chat/completions", json=_body(), timeout=60)
    assert answer.status_code == 408, answer.text
    assert "VLMSERVE_MEDIA_TIMEOUT" in answer.json()["error"]["message"]


async def test_metrics_count_media_items_and_their_seconds_and_nothing_stays_in_flight(
    make_client: Any,
) -> None:
    client = await make_client(media_workers=1)
    answer = await client.post("/v1/chat/completions", json=_body(), timeout=120)
    assert answer.status_code == 200, answer.text
    text = (await client.get("/metrics")).text
    assert 'vlmserve_media_items_total{kind="image"} 1.0' in text
    assert 'vlmserve_media_preprocess_seconds_count{kind="video"} 1.0' in text
    for gauge in ("media_bytes_in_flight", "media_queue_depth", "media_decodes_in_flight"):
        assert f"vlmserve_{gauge} 0.0" in text, gauge


async def test_with_the_media_memory_full_a_text_chat_is_answered_and_a_large_body_is_a_429(
    make_client: Any,
) -> None:
    client = await make_client(media_queue=0)
    budget = client._transport.app.state.services.media.budget  # type: ignore[attr-defined]
    held = await budget.admit(budget.total)  # other requests' media fill the budget
    try:
        text = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await client.post("/v1/chat/completions", json=text)).status_code == 200
        body = _body()
        body["messages"][0]["content"][0]["image_url"]["url"] = data_url(
            _noise_png(200, 200), "image/png"
        )
        answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 429, answer.text
        assert int(answer.headers["retry-after"]) >= 1
        assert answer.json()["error"]["code"] == "media_memory_busy"
    finally:
        held.release()
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
