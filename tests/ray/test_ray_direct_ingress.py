"""vlmserve on Ray Serve's direct ingress: no HTTP proxy, each ingress replica on its own port.

A local cluster of its own (the flag is read by Ray's processes when they start): 2 ingress
replicas and 1 model replica of the tiny checkpoint, streams shared through a private
redis-server. ``ingress_urls`` finds the replicas' ports (what ``vlmserve ray serve
--direct-ingress`` prints); a stream started on one replica's port resumes on the other's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sse_client import iter_events, read_events, text_of

pytest.importorskip("ray.serve", reason="ray is not installed: pip install -e '.[dev,ray]'")
import ray
from ray import serve
from ray_support import MODEL, write_config

from vlmserve.ray_serve.app import build_application, ingress_urls
from vlmserve.ray_serve.config import DIRECT_INGRESS_ENV, load_ray_setup
from vlmserve.ray_serve.ingress import REPLICA_HEADER

# A second cluster of its own, over 2 minutes on a 2-core machine: a release check (--long).
pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def replicas(
    tiny_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[str]]:
    tmp = tmp_path_factory.mktemp("direct")
    setup = load_ray_setup(write_config(tmp, tiny_dir, redis_url, model_replicas=1, embedder=False))
    before = os.environ.get(DIRECT_INGRESS_ENV)
    os.environ[DIRECT_INGRESS_ENV] = "1"  # before the cluster starts: its processes read it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1"})
        serve.run(build_application(setup), name="vlmserve", route_prefix="/")
        deadline = time.monotonic() + 60  # the replicas report their ports once serving
        while len(urls := ingress_urls("vlmserve", "127.0.0.1")) < 2:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for url in urls:  # serving, then warming up: /ready says 503 until the warm-up ends
            _wait_ready(url, time.monotonic() + 120)
        yield urls
    finally:
        serve.shutdown()
        ray.shutdown()
        if before is None:
            os.environ.pop(DIRECT_INGRESS_ENV, None)
        else:
            os.environ[DIRECT_INGRESS_ENV] = before


def _wait_ready(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def body() -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about the sea."}],
        "temperature": 0,
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
    }


def test_each_ingress_replica_serves_the_api_on_its_own_port(replicas: list[str]) -> None:
    assert len(replicas) == 2 and len(set(replicas)) == 2, replicas
    answered = set()
    for url in replicas:
        with httpx.Client(base_url=url, timeout=60) as c:
            ready = c.get("/ready")
            assert ready.status_code == 200, ready.text
            answered.add(ready.headers[REPLICA_HEADER])
            models = c.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == [MODEL]
    assert len(answered) == 2  # two replicas, not one answering twice


def test_a_stream_started_on_one_replicas_port_resumes_on_the_others(
    replicas: list[str],
) -> None:
    first_url, other_url = replicas
    with httpx.Client(base_url=first_url, timeout=120) as c:
        reference, _ = read_events(c, "POST", "/v1/chat/completions", json=body())
    with (
        httpx.Client(base_url=first_url, timeout=120) as c,
        c.stream(
            "POST", "/v1/chat/completions", json=body(), headers={"Accept": "text/event-stream"}
        ) as started,
    ):
        origin, sid = started.headers[REPLICA_HEADER], started.headers["x-session-id"]
        events = iter_events(started)
        first = [next(events) for _ in range(4)]
        with httpx.Client(base_url=other_url, timeout=120) as other:
            rest, answer = read_events(
                other, "GET", f"/v1/streams/{sid}", headers={"Last-Event-ID": first[-1].id}
            )
    assert answer.status_code == 200, answer.text
    assert answer.headers[REPLICA_HEADER] != origin
    assert text_of(first + rest) == text_of(reference)
    assert rest[-1].data == "[DONE]"
