"""The httptools protocol the server runs: request heads over 64 KiB get a 431, others pass,
also when the head arrives in one read together with its body or split over many reads."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from vlmserve.cli.http_protocol import MAX_HEAD_BYTES, CappedHttpToolsProtocol, with_head_timeout

pytestmark = pytest.mark.timeout(30)


async def _app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"got %d" % len(body)})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=free,
        http=CappedHttpToolsProtocol,
        log_level="error",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield free
    server.should_exit = True
    thread.join(5)


def _exchange(port: int, *parts: bytes) -> bytes:
    """Send ``parts`` (a pause between them: separate reads), then read until the server closes;
    a reset after the answer still returns what came before it."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            for part in parts:
                s.sendall(part)
                time.sleep(0.01)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed while we were sending: its answer may be waiting
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError as exc:
            out = out or repr(exc).encode()
    return out


def _head(header_bytes: int, body: bytes = b"") -> bytes:
    filler = b"X-Fill: " + b"a" * max(0, header_bytes) + b"\r\n"
    return (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)) + filler + b"\r\n"


def test_a_head_under_the_cap_is_served_even_with_a_large_body_in_the_same_read(port) -> None:
    body = b"b" * 300_000
    answer = _exchange(port, _head(MAX_HEAD_BYTES - 200, body) + body)
    assert answer.startswith(b"HTTP/1.1 200") and b"got 300000" in answer


def test_one_header_over_the_cap_gets_431(port) -> None:
    answer = _exchange(port, _head(MAX_HEAD_BYTES + 10))
    assert answer.startswith(b"HTTP/1.1 431") or b"Reset" in answer, answer[:80]


def test_many_small_headers_over_the_cap_get_431(port) -> None:
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))  # ~110 KB
    answer = _exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]


def test_a_head_split_over_reads_counts_every_read(port) -> None:
    pieces = [b"GET / HTTP/1.1\r\nHost: x\r\n"] + [b"X-A: " + b"a" * 9_000 + b"\r\n"] * 8
    answer = _exchange(port, *pieces, b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]


def test_keep_alive_requests_each_get_their_own_budget(port) -> None:
    one = _head(MAX_HEAD_BYTES // 2)
    answer = _exchange(port, one, one, one)
    assert answer.count(b"HTTP/1.1 200") == 3


@pytest.fixture(scope="module")
def short_deadline_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=free,
        http=with_head_timeout(0.5),
        log_level="error",
        lifespan="off",
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield free
    server.should_exit = True
    thread.join(5)


def _closed_after(sock: socket.socket, limit: float) -> tuple[bool, bytes]:
    """(whether the server closed ``sock`` within ``limit`` seconds, what it sent)."""
    sock.settimeout(limit)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return False, got
    except OSError:
        pass
    return True, got


def test_slow_and_silent_heads_are_closed_at_the_deadline(short_deadline_port) -> None:
    port = short_deadline_port
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    trickling = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    started = time.monotonic()
    for s in trickling:
        s.sendall(b"GET / HTTP/1.1\r\nX-Slow: ")
    for _ in range(3):  # then 1 byte each 0.1 s: the head never ends
        for s in trickling:
            s.sendall(b"a")
        time.sleep(0.1)
    results = [_closed_after(s, 3.0) for s in silent + trickling]
    elapsed = time.monotonic() - started
    for s in silent + trickling:
        s.close()
    assert all(closed for closed, _ in results), results
    assert all(got.startswith(b"HTTP/1.1 408") for _, got in results), results
    assert elapsed < 3.0


def test_a_prompt_head_and_a_kept_alive_connection_are_served(short_deadline_port) -> None:
    with socket.create_connection(("127.0.0.1", short_deadline_port), timeout=5) as s:
        for _ in range(2):  # the second request comes after the first one's deadline
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(0.8)
        s.sendall(b"GET / HTTP/1.1\r\n")  # a kept-alive request's head trickles: 408
        closed, got = _closed_after(s, 3.0)
    assert closed and got.startswith(b"HTTP/1.1 408")
