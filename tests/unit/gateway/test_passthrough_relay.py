"""The gateway's byte pass-through (``gateway/passthrough.py``): what a client receives does not
depend on where the network splits the worker's answer; a stream's later requests find the
replica that holds it, for as long as its sessions live."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from vlmserve.errors import ServiceUnavailable
from vlmserve.gateway.passed import PassedStreams
from vlmserve.gateway.passthrough import _media_kinds
from vlmserve.gateway.passthrough_relay import relay as _relay

pytestmark = pytest.mark.timeout(30)

EVENTS = (
    b'data: {"id":"chatcmpl-1","model":"up-name","choices":[{"delta":{"content":"H\xc3\xa9"}}]}\n\n'
    b'data: {"id":"chatcmpl-1","model":"up-name","choices":[{"delta":{},"finish_reason":"stop"}]}'
    b"\n\ndata: [DONE]\n\n"
)
RENAME = (b'"model":"up-name"', b'"model":"gw-name"')


@dataclass
class Answer:
    """An upstream answer as the relay sees it (``engine.protocol.PassedAnswer``)."""

    pieces: list[bytes]
    status: int = 200
    headers: Mapping[str, str] = field(
        default_factory=lambda: {
            "content-type": "text/event-stream",
            "x-session-id": "s1",
            "server": "uvicorn",
        }
    )
    replica_url: str = "http://replica"
    fail_after: int | None = None  # raise after this many pieces (the upstream broke off)

    async def chunks(self) -> AsyncIterator[bytes]:
        for i, piece in enumerate(self.pieces):
            if self.fail_after is not None and i >= self.fail_after:
                raise ServiceUnavailable("upstream broke off", code="upstream_error")
            yield piece

    def close(self, completed: bool) -> None:
        pass


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


Relayed = tuple[bool, list[dict[str, Any]], list[bytes]]  # read to the end, sent, seen


async def relayed(
    answer: Answer, rename: tuple[bytes, bytes] | None = RENAME, receive: Any = _never
) -> Relayed:
    sent: list[dict[str, Any]] = []
    seen: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    done = await _relay(answer, receive, send, rename, seen.append)
    return done, sent, seen


def _body(sent: list[dict[str, Any]]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("size", [1, 3, 7, 19, len(EVENTS)])
async def test_the_client_gets_whole_renamed_events_wherever_the_network_splits(size) -> None:
    pieces = [EVENTS[i : i + size] for i in range(0, len(EVENTS), size)]
    done, sent, seen = await relayed(Answer(pieces))
    assert done is True
    assert _body(sent) == EVENTS.replace(*RENAME)
    assert all(piece.endswith(b"\n\n") for piece in seen)  # never half an event
    assert sent[0]["status"] == 200
    assert dict(sent[0]["headers"]) == {
        b"content-type": b"text/event-stream",
        b"x-session-id": b"s1",
    }
    assert sent[-1]["more_body"] is False


async def test_without_a_rename_the_bytes_pass_unchanged() -> None:
    done, sent, _ = await relayed(Answer([EVENTS]), rename=None)
    assert done and _body(sent) == EVENTS


async def test_a_non_sse_answer_passes_whole() -> None:
    error = b'{"error": {"message": "no such session", "code": "session_not_found"}}'
    done, sent, _ = await relayed(Answer([error[:10], error[10:]], status=404))
    assert done and sent[0]["status"] == 404 and _body(sent) == error


async def test_an_upstream_that_breaks_off_ends_the_stream_with_an_error_event() -> None:
    pieces = [EVENTS[:50], EVENTS[50:]]
    done, sent, _ = await relayed(Answer(pieces, fail_after=1))
    assert done is False
    body = _body(sent)
    assert b'"code":"upstream_error"' in body.replace(b" ", b"")
    assert body.endswith(b"data: [DONE]\n\n") and sent[-1]["more_body"] is False


async def test_a_client_that_left_stops_the_relay() -> None:
    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    first, second = EVENTS.split(b"\n\n", 1)

    async def slow() -> AsyncIterator[bytes]:
        yield first + b"\n\n"
        await asyncio.sleep(0.05)
        yield second

    answer = Answer([])
    answer.chunks = slow  # type: ignore[method-assign]
    done, sent, _ = await relayed(answer, receive=gone)
    assert done is False
    assert _body(sent) == (first + b"\n\n").replace(*RENAME)


def test_the_media_kinds_of_a_raw_request_are_read_without_parsing_it() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:"}}
    video = {"type": "input_video", "video_url": "x"}
    body = {
        "messages": [
            {"role": "user", "content": [image, {"type": "text", "text": "x"}]},
            {"role": "user", "content": "plain"},
            "junk",
            {"role": "user", "content": [video, 3]},
        ]
    }
    assert frozenset(_media_kinds(body)) == {"vision", "video"}
    assert frozenset(_media_kinds({"messages": "nonsense"})) == frozenset()


def test_passed_streams_expire_with_their_sessions_and_keep_the_newest() -> None:
    now = [0.0]
    streams = PassedStreams(ttl=10, max_entries=3, clock=lambda: now[0])
    streams.add(["s1", "chatcmpl-1"], "backend", "http://a")
    assert streams.get("chatcmpl-1").replica_url == "http://a"
    now[0] = 5
    streams.add(["s2"], "backend", "http://b", RENAME)
    assert streams.get("s2").rename == RENAME
    now[0] = 10.5  # s1's entries are 10.5 s old
    assert streams.get("s1") is None and streams.get("s2") is not None
    streams.add(["s3", "s4", "s5"], "backend", "http://c")  # over 3: the oldest go
    assert len(streams) == 3 and streams.get("s2") is None
    assert streams.get("s5").replica_url == "http://c"


@pytest.mark.parametrize(
    ("extra", "passes"),
    [
        ({}, True),
        ({"n": 2}, True),
        ({"n": 3}, False),
        ({"n": "2"}, False),
        ({"max_tokens": 99}, True),
        ({"max_tokens": 100}, False),
        ({"max_completion_tokens": 100, "max_tokens": 5}, False),
        ({"images": 2}, True),
        ({"images": 3}, False),
    ],
)
def test_the_gateways_own_limits_send_a_request_to_the_full_path(extra, passes) -> None:
    """Over a limit of the gateway's: the full path refuses it with its 400 (not the worker)."""
    from types import SimpleNamespace

    from vlmserve.config import Settings
    from vlmserve.gateway.passthrough import PassthroughMiddleware

    settings = Settings(max_n=2, max_model_len=100, max_media_per_request=2)
    middleware = PassthroughMiddleware(
        None,  # type: ignore[arg-type]
        settings=settings,
        sessions=SimpleNamespace(durable=False),  # type: ignore[arg-type]
        models=SimpleNamespace(),  # type: ignore[arg-type]
        metrics=SimpleNamespace(),  # type: ignore[arg-type]
        errors=print,  # type: ignore[arg-type]
    )
    image = {"type": "image_url", "image_url": {"url": "data:"}}
    content = [image] * extra.pop("images", 1) + [{"type": "text", "text": "x"}]
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    assert middleware._within_limits(body, len(_media_kinds(body))) is passes


def test_the_metrics_of_a_passed_request_come_from_its_bytes() -> None:
    from vlmserve.api.metrics import Metrics
    from vlmserve.gateway.passthrough_relay import Observed

    metrics = Metrics()
    streamed = Observed(metrics, "gw")
    streamed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
    assert streamed.first is None  # the role chunk is not a token
    streamed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
    assert streamed.first is not None
    streamed(b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\n')
    streamed(b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n')
    streamed(b"data: [DONE]\n\n")  # the usage chunk and [DONE] in reads of their own
    streamed.finished()
    first = Observed(metrics, "gw")  # a vlmserve worker's first chunk: the role and a token
    first(b'data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}\n\n')
    assert first.first is not None
    whole = Observed(metrics, "gw")
    whole(
        b'{"choices":[{"message":{}}],"usage":{"prompt_tokens":5,"completion_tokens":2,'
        b'"total_tokens":7}}'
    )
    whole.finished()
    text = metrics.render().decode()
    assert 'vlmserve_output_tokens_total{model="gw"} 5.0' in text
    assert 'vlmserve_prompt_tokens_total{model="gw"} 12.0' in text
    assert 'vlmserve_time_to_first_token_seconds_count{model="gw"} 2.0' in text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, frozenset(s.labels.items()) - {("model_name", "gw"), ("engine", "0")}): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }  # and under vLLM's names
    assert samples[("vllm:generation_tokens_total", frozenset())] == 5
    for reason in ("length", "stop"):
        key = frozenset({("finished_reason", reason)})
        assert samples[("vllm:request_success_total", key)] == 1
    assert samples[("vllm:e2e_request_latency_seconds_count", frozenset())] == 2


async def test_a_whole_answer_is_read_before_its_status_goes_out() -> None:
    from vlmserve.gateway.passthrough_relay import relay_whole

    body = b'{"model":"up-name","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    ended: list[bool] = []
    answer = Answer([body[:9], body[9:]], headers={"content-type": "application/json"})
    assert await relay_whole(answer, send, RENAME, lambda b: None, lambda: ended.append(True))
    assert sent[0]["status"] == 200 and sent[1]["body"] == body.replace(*RENAME)
    assert sent[0]["headers"] == [(b"content-type", b"application/json")]
    assert sent[1]["more_body"] is False and ended == [True]
    broken = Answer([body[:9], body[9:]], fail_after=1)
    with pytest.raises(ServiceUnavailable):  # nothing sent: the caller answers with the error
        await relay_whole(broken, send, None, lambda b: None, lambda: None)
    assert len(sent) == 2


async def test_a_client_that_leaves_cancels_the_work_under_way() -> None:
    from vlmserve.gateway.passthrough_relay import unless_gone

    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def gone() -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    await asyncio.wait_for(unless_gone(work(), gone), 5)
    assert cancelled.is_set()

    async def fails() -> None:
        raise ServiceUnavailable("no replica")

    with pytest.raises(ServiceUnavailable):
        await unless_gone(fails(), _never)


async def test_a_non_sse_answer_is_renamed_too_and_seen_whole() -> None:
    body = b'{"error": {"message": "x"}, "model":"up-name"}'
    done, sent, seen = await relayed(Answer([body[:7], body[7:]], status=409))
    assert done and _body(sent) == body.replace(*RENAME) and seen == [body]
    assert sent[-1] == {
        "type": "http.response.body",
        "body": body.replace(*RENAME),
        "more_body": False,
    }


async def test_the_body_is_read_across_messages_and_replayed_once() -> None:
    from vlmserve.gateway.passthrough_relay import read_body, replay

    messages = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "more_body": True},
        {"type": "http.request", "body": b"c"},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    assert await read_body(receive) == b"abc"
    again = replay(b"abc", receive)
    assert await again() == {"type": "http.request", "body": b"abc", "more_body": False}
    assert await again() == {"type": "http.disconnect"}  # then the client's own messages


def test_a_stream_without_usage_records_its_ttft_alone() -> None:
    from vlmserve.api.metrics import Metrics
    from vlmserve.gateway.passthrough_relay import Observed

    metrics = Metrics()
    observed = Observed(metrics, "gw")
    observed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
    observed.finished()
    text = metrics.render().decode()
    assert 'vlmserve_time_to_first_token_seconds_count{model="gw"} 1.0' in text
    ttft = float(text.split('vlmserve_time_to_first_token_seconds_sum{model="gw"} ')[1].split()[0])
    assert 0 <= ttft < 5  # seconds since the request started, not a clock reading
    assert 'vlmserve_output_tokens_total{model="gw"}' not in text


def test_a_re_added_name_moves_to_the_newest_and_expiry_is_exact() -> None:
    now = [0.0]
    streams = PassedStreams(ttl=10, max_entries=2, clock=lambda: now[0])
    streams.add(["a"], "backend-1", "http://a")
    streams.add(["b"], "backend-1", "http://b")
    streams.add(["a"], "backend-2", "http://a2")  # "a" again: now the newest
    streams.add(["c"], "backend-1", "http://c")  # over 2: "b" goes, not "a"
    assert streams.get("b") is None and streams.get("a").backend == "backend-2"
    now[0] = 10.0  # "a" was re-added at 0: it expires exactly now
    assert streams.get("a") is None
    assert PassedStreams(ttl=1).max_entries == 65_536


def test_a_passed_stream_is_found_only_with_the_key_that_started_it() -> None:
    now = [0.0]
    streams = PassedStreams(ttl=10, clock=lambda: now[0])
    streams.add(["s1", "chatcmpl-1"], "backend", "http://a", owner="key-a")
    assert streams.get("s1", "key-a").replica_url == "http://a"
    assert streams.get("chatcmpl-1", "key-a").owner == "key-a"
    assert streams.get("s1", "key-b") is None and streams.get("chatcmpl-1", "key-b") is None
    assert streams.get("s1") is None  # no key is not the owner's key either
    streams.add(["s2"], "backend", "http://b")  # no keys configured: owner ""
    assert streams.get("s2").replica_url == "http://b" and streams.get("s2", "key-a") is None
    now[0] = 10.0  # s1 expires exactly now: the next add drops it from memory
    streams.add(["s3"], "backend", "http://c")
    assert len(streams) == 1 and streams.get("s3").replica_url == "http://c"


@pytest.mark.parametrize("proxied", [False, True])
async def test_a_chat_body_is_read_for_a_pass_only_where_a_model_is_proxied(proxied) -> None:
    """Without a proxied model nothing can be passed: the full path gets the body without the
    pass-through parsing it first (an image request's body is hundreds of KB)."""
    from types import SimpleNamespace

    from vlmserve.config import Settings
    from vlmserve.gateway.passthrough import PassthroughMiddleware

    seen: list[bytes] = []

    async def full_path(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])

    local = SimpleNamespace(backend=SimpleNamespace(proxied=False))
    remote = SimpleNamespace(backend=SimpleNamespace(proxied=True))
    middleware = PassthroughMiddleware(
        full_path,
        settings=Settings(),
        sessions=SimpleNamespace(durable=False),  # type: ignore[arg-type]
        models=SimpleNamespace(handles=[local, remote] if proxied else [local]),  # type: ignore[arg-type]
        metrics=SimpleNamespace(),  # type: ignore[arg-type]
        errors=print,  # type: ignore[arg-type]
    )
    planned: list[bytes] = []
    middleware._plan = lambda body, scope: planned.append(body)  # type: ignore[method-assign]
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    messages = [{"type": "http.request", "body": body}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    scope.update(headers=[], query_string=b"")
    await middleware(scope, receive, print)
    assert seen == [body]
    assert planned == ([body] if proxied else [])
