"""Resume tokens: which requests a token alone may open, the first event that carries one, and
the access-log lines that must not."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from vlmserve.api.auth import AuthMiddleware
from vlmserve.api.resume_token import (
    RESUME_TOKEN_OWNER,
    issue,
    redact_tokens,
    token_alias,
    with_token,
)


async def _let_in(
    path: str,
    query: str = "token=t0k",
    method: str = "GET",
    raw: bytes | None = None,
    *headers: tuple[bytes, bytes],
) -> Any:
    """The owner a keyed server's auth gives the request, or None when it is refused."""
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["state"]["owner"])

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        pass

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": raw if raw is not None else path.encode(),
        "query_string": query.encode(),
        "headers": list(headers),
    }
    await AuthMiddleware(app, api_keys=["k1"])(scope, receive, send)
    return seen[0] if seen else None


@pytest.mark.parametrize(
    "path,query",
    [
        ("/v1/streams/abc", "token=t0k"),
        ("/v1/streams/chatcmpl-1", "last_event_id=chatcmpl-1%3A3&token=t0k"),
        ("/v1/responses/resp_1", "stream=true&token=t0k&starting_after=3"),
        ("/v1/streams/abc", "token=x"),  # a token's length is the route's to judge, up to ...
        ("/v1/streams/abc", "token=" + "x" * 128),  # ... 128 characters
    ],
)
async def test_a_token_alone_opens_a_stream_get_with_no_keys_namespace(
    path: str, query: str
) -> None:
    assert await _let_in(path, query) == RESUME_TOKEN_OWNER


@pytest.mark.parametrize(
    "path,query,method,raw",
    [
        ("/v1/streams/abc", "", "GET", None),  # no token
        ("/v1/streams/abc", "token=", "GET", None),
        ("/v1/streams/abc", "token=a&token=b", "GET", None),
        ("/v1/streams/abc", "token=" + "x" * 129, "GET", None),
        ("/v1/responses/resp_1", "token=t0k", "GET", None),  # the JSON response, not its events
        ("/v1/responses/resp_1", "stream=false&token=t0k", "GET", None),
        ("/v1/responses/resp_1/input_items", "stream=true&token=t0k", "GET", None),
        ("/v1/streams/abc", "token=t0k", "POST", None),
        ("/v1/cancel/abc", "token=t0k", "POST", None),
        ("/v1/chat/completions", "token=t0k", "POST", None),
        ("/v1/files", "token=t0k", "GET", None),
        ("/v1/streams/abc/x", "token=t0k", "GET", None),
        ("/v1/streams/abc", "token=t0k", "GET", b"/v1/streams/..%2F..%2Fv1%2Ffiles"),  # raw differs
        ("/admin/state", "token=t0k", "GET", None),
    ],
)
async def test_a_token_opens_no_other_request(
    path: str, query: str, method: str, raw: bytes | None
) -> None:
    assert await _let_in(path, query, method, raw) is None


async def test_a_key_decides_the_owner_even_beside_a_token() -> None:
    owner = await _let_in(
        "/v1/streams/abc", "token=t0k", "GET", None, (b"authorization", b"Bearer k1")
    )
    assert owner not in (None, RESUME_TOKEN_OWNER)
    refused = await _let_in(
        "/v1/streams/abc", "token=t0k", "GET", None, (b"authorization", b"Bearer wrong")
    )
    assert refused is None  # a wrong key is refused, token or not


def test_tokens_are_random_and_only_their_digest_names_the_session() -> None:
    (one, alias), (two, _) = issue(), issue()
    assert one != two and len(one) == 32  # 24 random bytes, URL-safe base64
    assert alias == token_alias(one) and one not in alias and alias.startswith("rt-")


def test_the_first_event_carries_the_token_as_its_first_field() -> None:
    data = json.dumps({"id": "chatcmpl-1", "choices": []})
    assert json.loads(with_token(data, "t0k")) == {"resume_token": "t0k", **json.loads(data)}
    assert with_token("{}", "t0k") == '{"resume_token":"t0k"}'
    assert with_token('{"a":1} ', "t0k") == '{"resume_token":"t0k","a":1} '
    assert with_token("[DONE]", "t0k") == "[DONE]"


def test_access_log_lines_never_show_a_token() -> None:
    redact_tokens()
    redact_tokens()  # idempotent
    line = '%s - "%s %s HTTP/%s" %d'  # uvicorn's access-log format
    for name in ("uvicorn.access", "vlmserve.access"):
        logger = logging.getLogger(name)
        ours = [f for f in logger.filters if type(f).__name__ == "_RedactTokens"]
        assert len(ours) == 1, name
        # the record as the logger hands it to its filters (other libraries in the test
        # session may add filters of their own: ours alone is judged)
        shown = []
        for path in (
            "/v1/streams/abc?last_event_id=abc%3A3&token=s3cr3t&x=1",
            "/v1/responses/r?TOKEN=s3cr3t",
        ):
            args = ("127.0.0.1:5", "GET", path, "1.1", 200)
            record = logger.makeRecord(name, logging.INFO, __file__, 1, line, args, None)
            assert ours[0].filter(record)
            shown.append(record.getMessage())
        assert not any("s3cr3t" in s for s in shown), shown
        assert "token=***&x=1" in shown[0] and "last_event_id=abc%3A3" in shown[0]
        assert shown[0].startswith('127.0.0.1:5 - "GET /v1/streams/abc?') and '1.1" 200' in shown[0]
