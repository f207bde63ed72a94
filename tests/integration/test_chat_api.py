"""/v1/chat/completions in-process on the tiny real Qwen2-VL: answers, usage, media, 4xx."""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Any

import httpx
import pytest

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.engine.types import ChatMessage, ImagePart, TextPart
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import data_url, gradient_image, image_bytes, mp4_bytes


def chat(content: Any, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 8,
    }
    return {**body, **extra}


def image_message(url: str, text: str = "Describe the image.") -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def test_text_completion_has_openai_shape_and_usage(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat("Hello there", ignore_eos=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert r.headers["x-request-id"]


async def test_prompt_tokens_match_the_processor_count(
    client: httpx.AsyncClient, chat_models: ModelManager
) -> None:
    image = gradient_image(64, 64)
    r = await client.post(
        "/v1/chat/completions",
        json=chat(image_message(data_url(image_bytes(64, 64), "image/png"), "What is this?")),
    )
    assert r.status_code == 200, r.text
    backend = chat_models.resolve(MODEL).backend
    message = ChatMessage("user", [ImagePart(image), TextPart("What is this?")])
    rendered = backend.render_prompt([message])
    expected = backend.processor(text=[rendered], images=[image], return_tensors="pt")
    assert r.json()["usage"]["prompt_tokens"] == expected["input_ids"].shape[1]


async def test_greedy_is_deterministic_and_seeded_sampling_repeats(
    client: httpx.AsyncClient,
) -> None:
    greedy = [await client.post("/v1/chat/completions", json=chat("Hi")) for _ in range(2)]
    assert greedy[0].json()["choices"][0]["message"] == greedy[1].json()["choices"][0]["message"]
    body = chat("Hi", temperature=1.0, seed=1234, max_tokens=12)
    sampled = [(await client.post("/v1/chat/completions", json=body)).json() for _ in range(2)]
    assert sampled[0]["choices"][0]["message"] == sampled[1]["choices"][0]["message"]


async def test_stop_string_ends_generation_without_the_stop_text(client: httpx.AsyncClient) -> None:
    free = (await client.post("/v1/chat/completions", json=chat("Hi", max_tokens=24))).json()
    text = free["choices"][0]["message"]["content"]
    if len(text) < 6:
        pytest.skip("the random model produced too little text to pick a stop string from")
    stop = text[3:5]
    cut = await client.post("/v1/chat/completions", json=chat("Hi", max_tokens=24, stop=[stop]))
    body = cut.json()
    assert body["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_video_is_sampled_to_the_frame_limit(make_client: Any) -> None:
    video = data_url(mp4_bytes(frames=40), "video/mp4")  # 5 s: Qwen2-VL takes 10 frames at 2 fps
    content = [{"type": "video_url", "video_url": {"url": video}}, {"type": "text", "text": "?"}]
    limited = await make_client(max_video_frames=4)
    unlimited = await make_client(max_video_frames=16)
    r4 = await limited.post("/v1/chat/completions", json=chat(content))
    r10 = await unlimited.post("/v1/chat/completions", json=chat(content))
    small = data_url(mp4_bytes(frames=4), "video/mp4")
    small_content = [{"type": "input_video", "b64_json": small.split(",", 1)[1]}, content[1]]
    r_small = await unlimited.post("/v1/chat/completions", json=chat(small_content))
    for r in (r4, r10, r_small):
        assert r.status_code == 200, r.text
    tokens = [r.json()["usage"]["prompt_tokens"] for r in (r4, r10, r_small)]
    assert tokens[0] == tokens[2] < tokens[1]  # 40 frames sampled down to 4 == a 4-frame clip


async def test_input_image_raw_base64_is_accepted(client: httpx.AsyncClient) -> None:
    b64 = base64.b64encode(image_bytes(40, 30, fmt="JPEG")).decode()
    content = [{"type": "input_image", "b64_json": b64}, {"type": "text", "text": "hi"}]
    r = await client.post("/v1/chat/completions", json=chat(content))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("size", [(1, 1), (1, 60), (3, 2)])
async def test_tiny_images_are_upscaled_not_crashed(client: httpx.AsyncClient, size: tuple) -> None:
    url = data_url(image_bytes(*size), "image/png")
    r = await client.post("/v1/chat/completions", json=chat(image_message(url)))
    assert r.status_code == 200, r.text


BAD_REQUESTS = {
    "undecodable image": (image_message(data_url(b"not an image at all", "image/png")), 400),
    "loopback url": (image_message("http://127.0.0.1:9/cat.png"), 400),
    "metadata url": (image_message("http://169.254.169.254/latest/meta-data/"), 400),
    "file url": (image_message("file:///etc/passwd"), 400),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
async def test_bad_media_gets_a_4xx_and_the_server_keeps_serving(
    client: httpx.AsyncClient, name: str
) -> None:
    content, status = BAD_REQUESTS[name]
    error = assert_openai_error(
        await client.post("/v1/chat/completions", json=chat(content)), status
    )
    assert "Traceback" not in error["message"]
    assert error["param"].startswith("messages[0].content[0]")
    ok = await client.post("/v1/chat/completions", json=chat("still there?"))
    assert ok.status_code == 200


async def test_image_over_the_pixel_limit_is_413(make_client: Any) -> None:
    client = await make_client(max_image_pixels=100 * 100)
    url = data_url(image_bytes(200, 120), "image/png")
    assert_openai_error(
        await client.post("/v1/chat/completions", json=chat(image_message(url))), 413
    )


async def test_body_over_the_size_limit_is_413_before_parsing(make_client: Any) -> None:
    client = await make_client(max_body_bytes=10_000)
    r = await client.post("/v1/chat/completions", json=chat("x" * 20_000))
    assert_openai_error(r, 413, "payload_too_large")


async def test_more_media_items_than_allowed_is_400(make_client: Any) -> None:
    client = await make_client(max_media_per_request=2)
    url = data_url(image_bytes(8, 8), "image/png")
    content = [{"type": "image_url", "image_url": url}] * 3
    assert_openai_error(
        await client.post("/v1/chat/completions", json=chat(content)), 400, "too_many_media_items"
    )


async def test_schema_violation_is_400_and_unknown_model_404(client: httpx.AsyncClient) -> None:
    bad = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": "nope"})
    assert assert_openai_error(bad, 400)["param"] == "messages"
    missing = await client.post("/v1/chat/completions", json={**chat("hi"), "model": "gpt-9"})
    assert MODEL in assert_openai_error(missing, 404, "model_not_found")["message"]


async def test_absurd_n_and_max_tokens_are_refused(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.post("/v1/chat/completions", json=chat("a", n=64)), 400)
    big = chat("a", max_tokens=10**9)
    assert_openai_error(await client.post("/v1/chat/completions", json=big), 400)


async def test_health_and_models(client: httpx.AsyncClient) -> None:
    health = (await client.get("/health")).json()
    assert health["ok"] is True and health["modelReady"] is True and health["modelId"] == MODEL
    assert (await client.get("/ready")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


async def test_ready_is_503_while_loading_then_200(make_client: Any, tiny_dir: Any) -> None:
    manager = ModelManager.from_settings(make_settings(tiny_dir, activation_timeout_seconds=0.2))
    backend = manager.handles[0].backend
    gate = threading.Event()
    real_load = backend.load
    backend.load = lambda: (gate.wait(30), real_load())  # type: ignore[method-assign]
    app = build_app(make_settings(tiny_dir), models=manager)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            loading = await c.get("/ready")
            assert loading.status_code == 503 and loading.headers["retry-after"]
            busy = await c.post("/v1/chat/completions", json=chat("hi"))
            assert_openai_error(busy, 503)
            assert busy.headers["retry-after"]
            gate.set()
            for _ in range(300):
                if (await c.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            assert (await c.get("/ready")).status_code == 200
            assert (await c.post("/v1/chat/completions", json=chat("hi"))).status_code == 200
    manager.close()
