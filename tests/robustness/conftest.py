"""Shared pieces of the robustness suite: the CI/--long scale, a sentinel listener, an
audit-hook connect recorder, memory and descriptor probes, and a metrics reader.

Every knob that --long raises lives in ``Scale`` so the two modes differ in one place.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

# What no client-facing body may ever contain (the CVE-2026-22778 lesson: a decoder error
# leaked a heap address, which made a memory-corruption bug exploitable).
LEAK_PATTERNS = (
    re.compile(r"Traceback \(most recent call last\)"),
    re.compile(r"0x[0-9a-fA-F]{8,}"),
    re.compile(r"site-packages|dist-packages|/usr/lib/python|\.pyenv/"),
    re.compile(re.escape(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))),
    re.compile(r'File "[^"]+", line \d+'),
)


def leaks(text: str) -> list[str]:
    """The leak patterns ``text`` matches (empty: clean)."""
    return [p.pattern for p in LEAK_PATTERNS if p.search(text)]


@dataclass(slots=True, frozen=True)
class Scale:
    """Example counts and durations: CI mode (default) or release mode (--long)."""

    long: bool
    fuzz_examples: int  # schemathesis examples per operation
    property_examples: int  # hypothesis examples per parser property
    disconnects: int  # streams dropped at random points
    load_seconds: float  # duration of the 64-stream load
    fault_runs: int  # SIGTERM drains


@pytest.fixture(scope="session")
def scale(request: pytest.FixtureRequest) -> Scale:
    if request.config.getoption("--long", default=False):
        return Scale(
            True,
            fuzz_examples=60,
            property_examples=600,
            disconnects=100,
            load_seconds=60.0,
            fault_runs=3,
        )
    return Scale(
        False,
        fuzz_examples=8,
        property_examples=60,
        disconnects=20,
        load_seconds=10.0,
        fault_runs=1,
    )


# -- sentinel listener --------------------------------------------------------------------


@dataclass(slots=True)
class Sentinel:
    """Real TCP listeners on 127.0.0.1 and ::1 at one port; counts every connection."""

    port: int
    hits: list[tuple[str, int]] = field(default_factory=list)
    sockets: list[socket.socket] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def serve(self, sock: socket.socket) -> None:
        sock.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, addr = sock.accept()
            except (TimeoutError, OSError):
                continue
            self.hits.append(addr[:2])
            conn.close()


def _bind_both() -> list[socket.socket]:
    """A v4 and (where available) a v6 loopback listener on the same free port."""
    for _ in range(20):
        v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        v4.bind(("127.0.0.1", 0))
        port = v4.getsockname()[1]
        try:
            v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            v6.bind(("::1", port))
        except OSError:
            v6.close()
            if socket.has_ipv6 and _ipv6_loopback():
                v4.close()
                continue  # port taken on ::1; try another
            return [v4]
        return [v4, v6]
    raise RuntimeError("no free port on both 127.0.0.1 and ::1")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def sentinel() -> Iterator[Sentinel]:
    socks = _bind_both()
    s = Sentinel(port=socks[0].getsockname()[1], sockets=socks)
    threads = []
    for sock in socks:
        sock.listen(64)
        t = threading.Thread(target=s.serve, args=(sock,), daemon=True)
        t.start()
        threads.append(t)
    yield s
    s.stop.set()
    for t in threads:
        t.join(timeout=2)
    for sock in socks:
        sock.close()


# -- audit hook: every socket.connect in this process ------------------------------------

_CONNECTS: list[Any] = []
_RECORDING = threading.Event()
_HOOKED = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect" and _RECORDING.is_set():
        _CONNECTS.append(args[1])


@pytest.fixture
def connect_log() -> Iterator[list[Any]]:
    """Addresses passed to ``socket.connect`` (any thread) while the test runs."""
    global _HOOKED
    if not _HOOKED:  # audit hooks cannot be removed; one per process, switched on and off
        sys.addaudithook(_audit)
        _HOOKED = True
    _CONNECTS.clear()
    _RECORDING.set()
    try:
        yield _CONNECTS
    finally:
        _RECORDING.clear()


# -- probes ----------------------------------------------------------------------------------


def rss_bytes(pid: int | None = None) -> int:
    return psutil.Process(pid).memory_info().rss


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
