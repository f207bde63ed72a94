"""``/tokenize`` and ``/detokenize`` (vLLM's shapes) on the tiny Qwen2-VL: a chat's ``count``
is the ``usage.prompt_tokens`` of the same chat request, for text, image and video."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from support import MODEL
from vlmserve.testing.media import data_url, image_bytes, mp4_bytes

IMAGE = {"type": "image_url", "image_url": {"url": data_url(image_bytes(64, 48), "image/png")}}
VIDEO = {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(frames=6), "video/mp4")}}
CONVERSATIONS = {
    "text": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    "image": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}]}],
    "two images": [{"role": "user", "content": [IMAGE, IMAGE, {"type": "text", "text": "?"}]}],
    "video": [{"role": "user", "content": [VIDEO, {"type": "text", "text": "What happens?"}]}],
}


@pytest.mark.parametrize("kind", list(CONVERSATIONS))
async def test_the_count_equals_the_chat_requests_prompt_tokens(
    client: httpx.AsyncClient, kind: str
) -> None:
    messages = CONVERSATIONS[kind]
    r = await client.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > body["count"]
    chat = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
    )
    assert chat.status_code == 200, chat.text
    assert body["count"] == chat.json()["usage"]["prompt_tokens"]
    back = await client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200
    assert back.json()["prompt"].startswith("<|im_start|>system\n")  # the template, specials kept


async def test_a_prompt_is_tokenized_alone_and_detokenized_back(
    client: httpx.AsyncClient, tiny_dir: Any
) -> None:
    text = "Hello wörld, 中文"
    r = await client.post("/tokenize", json={"prompt": text})  # the chat model by role
    assert r.status_code == 200, r.text
    expected = AutoTokenizer.from_pretrained(tiny_dir).encode(text)
    assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    back = await client.post("/detokenize", json={"tokens": expected})
    assert back.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ({}, None),
        ({"prompt": "a", "return_token_strs": True}, "return_token_strs"),
        (
            {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": False},
            "add_generation_prompt",
        ),
        (
            {
                "messages": [{"role": "user", "content": "b"}],
                "mm_processor_kwargs": {"max_pixels": 10**12},
            },
            "mm_processor_kwargs.max_pixels",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
    ],
)
async def test_bad_tokenize_requests_are_400s(
    client: httpx.AsyncClient, body: dict[str, Any], param: str | None
) -> None:
    r = await client.post("/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


async def test_detokenize_refuses_ids_outside_the_vocabulary(client: httpx.AsyncClient) -> None:
    r = await client.post("/detokenize", json={"model": MODEL, "tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
