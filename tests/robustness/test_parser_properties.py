"""Parser properties (hypothesis): random mixes of content parts, data URLs, base64, broken
unicode and absurd sampling numbers, sent through the real app in-process.

Pass: every answer is 200 or a 400 / 413 in the OpenAI error shape, and no body contains a
traceback, a memory address (``0x`` + 8 hex digits) or an absolute server path.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Scale, leaks
from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import data_url, image_bytes, mp4_bytes

pytestmark = pytest.mark.robustness

ALLOWED = {200, 400, 413}
PNG = image_bytes(8, 8)
MP4 = mp4_bytes(frames=2, width=16, height=16)

HUGE_INTS = [0, -1, 2**31, 2**63, 2**64 + 1, 10**30, 10**400]
HUGE_FLOATS = [float("inf"), float("-inf"), float("nan"), 1e308, -1e308, 5e-324]
NUMBERS = (
    st.sampled_from(HUGE_INTS + HUGE_FLOATS) | st.integers() | st.floats() | st.text(max_size=5)
)

text = st.text(max_size=40) | st.sampled_from(
    ["\x00", "\u202e\ufeff", "é" * 50, "\U0001f600" * 20, "\ud800", "a\udfffb"]
)
b64_junk = st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())
sources = st.one_of(
    st.just(data_url(PNG, "image/png")),
    st.just(base64.b64encode(PNG).decode()),
    st.just(data_url(PNG, "image/png")[:-7]),  # truncated base64
    st.just(data_url(PNG, "text/plain")),  # mislabelled
    st.just(data_url(MP4, "video/mp4")),
    b64_junk.map(lambda s: "data:image/png;base64," + s),
    b64_junk,
    text,
    st.sampled_from(
        [
            "http://127.0.0.1:1/x.png",
            "file:///etc/passwd",
            "/etc/passwd",
            "gopher://x",
            "data:,",
            "data:image/png;base64,====",
            "//x",
            "https://",
        ]
    ),
)


def _ref(src: st.SearchStrategy) -> st.SearchStrategy:
    return src | st.fixed_dictionaries({"url": src}) | st.fixed_dictionaries({"url": NUMBERS})


parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": _ref(sources)}),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": _ref(sources)}),
    st.fixed_dictionaries({"type": st.just("input_image"), "b64_json": sources}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_video", "audio_url", "", "IMAGE_URL"])}),
    st.dictionaries(st.text(max_size=8), NUMBERS | text, max_size=3),
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]),
            "content": text | st.lists(parts, max_size=3) | st.none() | NUMBERS,
        }
    ),
    min_size=0,
    max_size=3,
)
shaped_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": _ref(sources)}),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": sources}),
    st.fixed_dictionaries({"type": st.just("input_image"), "b64_json": sources}),
)
shaped_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.lists(shaped_parts, min_size=1, max_size=3)}
    ),
    min_size=1,
    max_size=2,
)
sampling = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 3) | st.integers(1, 3) | NUMBERS},
    optional={
        k: NUMBERS
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "n",
            "seed",
            "min_tokens",
            "repetition_penalty",
            "max_completion_tokens",
        )
    }
    | {"stop": st.lists(text, max_size=3) | NUMBERS, "stream": st.booleans()},
)


plain_sampling = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 3)},
    optional={
        "temperature": st.floats(0, 2),
        "seed": st.integers(0, 2**31),
        "top_k": st.integers(-1, 50),
        "stream": st.booleans(),
        "stop": st.lists(text, max_size=2),
    },
)


def _encode(body: dict[str, Any]) -> bytes:
    """JSON as a client might send it: NaN/Infinity literals and lone surrogates included."""
    return json.dumps(body, allow_nan=True).encode()


@pytest.fixture
def app_client(
    tiny_dir: Path, chat_models: ModelManager
) -> Iterator[tuple[Any, httpx.AsyncClient]]:
    """A private event loop running the app (lifespan entered) and an ASGI client on it."""
    runner = asyncio.Runner()
    app = build_app(make_settings(tiny_dir, max_model_len=256, max_tokens=3), models=chat_models)
    lifespan = app.router.lifespan_context(app)
    runner.run(lifespan.__aenter__())
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://t",
        timeout=30,
    )
    yield runner, client
    runner.run(client.aclose())
    runner.run(lifespan.__aexit__(None, None, None))
    runner.close()


async def _post(client: httpx.AsyncClient, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return await client.post("/v1/chat/completions", content=body, headers=headers)


def _assert_clean(response: httpx.Response) -> None:
    assert response.status_code in ALLOWED, (response.status_code, response.text[:500])
    assert not leaks(response.text), response.text[:500]
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]


def test_random_chat_bodies_get_200_or_a_clean_4xx(app_client: Any, scale: Scale) -> None:
    runner, client = app_client
    seen: Counter = Counter()

    @given(msgs=messages | shaped_messages | shaped_messages, params=plain_sampling | sampling)
    @settings(
        max_examples=scale.property_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(msgs: list[dict[str, Any]], params: dict[str, Any]) -> None:
        body = {"model": MODEL, "messages": msgs, **params}
        response = runner.run(_post(client, _encode(body)))
        seen[response.status_code] += 1
        _assert_clean(response)

    run()
    print(f"\nchat bodies: {dict(seen)}")
    assert sum(seen.values()) >= scale.property_examples // 2


NASTY = [
    b"\xff\xfe\x00",
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
    b"[" * 10000,
    b'{"a":' * 5000,
    b"1e999999",
    b'"\\ud800"',
    b"{" + b" " * 100000 + b"}",
]


def test_raw_bytes_and_broken_utf8_bodies_are_4xx_never_5xx(app_client: Any) -> None:
    runner, client = app_client
    statuses: Counter = Counter()

    def send(body: bytes) -> None:
        response = runner.run(_post(client, body))
        statuses[response.status_code] += 1
        _assert_clean(response)

    @given(raw=st.binary(max_size=300))
    @settings(
        max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def run(raw: bytes) -> None:
        send(b'{"model": "tiny", "messages": [{"role": "user", "content": "' + raw + b'"}]}')

    run()
    for body in NASTY:
        send(body)
    print(f"\nraw bodies: {dict(statuses)}")


@pytest.mark.parametrize("content", ["\ud800", [{"type": "text", "text": "a\udfffb"}]])
def test_lone_surrogate_in_text_is_a_4xx_not_a_500(app_client: Any, content: Any) -> None:
    runner, client = app_client
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    response = runner.run(_post(client, _encode(body)))
    _assert_clean(response)
