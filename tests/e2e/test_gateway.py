"""A gateway in front of real vlmserve worker processes (tiny checkpoint, loopback ports)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from sse_client import read_events, without_token
from support import LiveServer, ServerProcess
from vlmserve.api.app import build_app
from vlmserve.config import Settings

ADMIN = {"Authorization": "Bearer adm"}
WORKER_ADMIN = {"Authorization": "Bearer wk"}


def worker(tiny_dir: Path) -> ServerProcess:
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"]
    return ServerProcess(args, env={"VLMSERVE_ADMIN_KEYS": '["wk"]'})


def registry(path: Path, entry: str) -> str:
    path.write_text(entry)
    return str(path)


def gateway_settings(reg: str, **kw: Any) -> Settings:
    base = {
        "registry": reg,
        "device": "cpu",
        "admin_keys": ["adm"],
        "upstream_max_failures": 1,
        "upstream_health_interval": 0.5,
        "upstream_eject_seconds": 60,
    }
    return Settings(**{**base, **kw})


@pytest.fixture(scope="module")
def workers(tiny_dir: Path) -> Iterator[list[ServerProcess]]:
    procs = [worker(tiny_dir), worker(tiny_dir)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def gateway(
    workers: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with gateway_over(workers, tmp_path_factory.mktemp("gw")) as url:
        yield url


@contextlib.contextmanager
def gateway_over(
    workers: list[ServerProcess],
    work: Path,
    entry: str = 'name = "tiny"\n',
    upstream: str = "",
    **settings: Any,
) -> Iterator[str]:
    """A gateway (in process) whose one ``openai`` entry has the workers as replicas
    (``upstream``: more ``backend_config`` lines)."""
    urls = json.dumps([w.url for w in workers])
    reg = registry(
        work / "registry.toml",
        f'[[models]]\n{entry}backend = "openai"\n[models.backend_config]\nbase_urls = {urls}\n'
        + upstream,
    )
    with LiveServer(build_app(gateway_settings(reg, **settings))) as server:
        wait_ready(server.url)
        yield server.url


def wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/ready").status_code != 200:
        assert time.monotonic() < deadline, httpx.get(f"{url}/ready").text
        time.sleep(0.1)


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        **extra,
    }


def data_lines(text: str) -> list[str]:
    """Each SSE message's data line (a replay adds ``id:`` lines: the resumable wire), without
    the resume token that only the answer which started the stream carries."""
    lines = [m.split("\n")[-1] for m in text.split("\n\n") if m]
    return [f"data: {without_token(line.removeprefix('data: '))}" for line in lines]


def replicas(gw: str) -> dict[str, dict[str, Any]]:
    models = httpx.get(f"{gw}/v1/gateway/replicas", headers=ADMIN).json()["models"]
    return {r["url"]: r for r in models[0]["replicas"]}


def in_flight(workers: list[ServerProcess]) -> int:
    total = 0
    for w in workers:
        state = httpx.get(f"{w.url}/admin/state", headers=WORKER_ADMIN).json()
        total += sum(m["in_flight"] for m in state["models"])
    return total


def test_requests_spread_across_both_workers(gateway: str, workers: list[ServerProcess]) -> None:
    for _ in range(6):
        assert (
            httpx.post(f"{gateway}/v1/chat/completions", json=chat(), timeout=60).status_code == 200
        )
    counts = [replicas(gateway)[w.url]["requests"] for w in workers]
    assert all(c >= 2 for c in counts), counts


def test_stream_resumes_with_last_event_id_after_disconnect(gateway: str) -> None:
    with httpx.Client(timeout=60) as client:
        body = chat(stream=True, session_id="gw-resume", max_tokens=40)
        first, r = read_events(client, "POST", f"{gateway}/v1/chat/completions", json=body, limit=3)
        assert r.status_code == 200 and len(first) == 3
        rest, r = read_events(
            client,
            "GET",
            f"{gateway}/v1/streams/gw-resume",
            headers={"Last-Event-ID": first[-1].id},
        )
    assert r.status_code == 200
    assert [e.index for e in rest] == list(range(3, 3 + len(rest)))
    assert rest[-1].data == "[DONE]"
    assert any(e.finish_reason == "length" for e in rest)


def test_gateway_streams_on_the_openai_wire_by_default(gateway: str) -> None:
    """Workers answer the gateway on the OpenAI wire; the gateway's own client gets it too
    unless it asks for ``id:`` lines: every message is ``data: <json>``, as vLLM parses."""
    body = chat(stream=True, max_tokens=6, ignore_eos=True, stream_options={"include_usage": True})
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["x-session-id"]
    messages = [m for m in r.text.split("\n\n") if m]
    assert all(m.startswith("data: ") and "\n" not in m for m in messages), messages
    assert messages[-1] == "data: [DONE]"
    chunks = [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["choices"] == []
    replay = httpx.get(f"{gateway}/v1/streams/{r.headers['x-session-id']}", timeout=60)
    assert data_lines(replay.text) == data_lines(r.text)


def test_cancel_at_the_gateway_stops_generation_on_the_worker(
    gateway: str, workers: list[ServerProcess]
) -> None:
    body = chat(stream=True, session_id="gw-cancel", max_tokens=20000, ignore_eos=True)
    with httpx.Client(timeout=60) as client:
        _, r = read_events(client, "POST", f"{gateway}/v1/chat/completions", json=body, limit=3)
        assert r.status_code == 200
        assert in_flight(workers) == 1
        r = client.post(f"{gateway}/v1/cancel/gw-cancel")
        assert r.status_code == 200 and r.json()["cancelled"] is True
    deadline = time.monotonic() + 15
    while in_flight(workers):
        assert time.monotonic() < deadline, "the worker still generates after the cancel"
        time.sleep(0.1)


def test_a_stream_passes_through_as_the_workers_own_session(
    gateway: str, workers: list[ServerProcess]
) -> None:
    """The lean path: the worker runs the session the client resumes at the gateway."""
    body = chat(stream=True, max_tokens=5, ignore_eos=True)
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    sid = r.headers["x-session-id"]
    held = [httpx.get(f"{w.url}/v1/streams/{sid}", timeout=60) for w in workers]
    assert sorted(h.status_code for h in held) == [200, 404]  # one worker holds it
    assert data_lines(next(h.text for h in held if h.status_code == 200)) == data_lines(r.text)
    assert data_lines(httpx.get(f"{gateway}/v1/streams/{sid}", timeout=60).text) == data_lines(
        r.text
    )


def test_passed_requests_take_n_and_logprobs_and_name_the_gateways_entry(
    workers: list[ServerProcess], tmp_path: Path
) -> None:
    with gateway_over(workers, tmp_path, 'name = "gw-tiny"\nserved_model_id = "tiny"\n') as gw:
        body = chat(
            model="gw-tiny",
            stream=True,
            n=2,
            max_tokens=4,
            ignore_eos=True,
            stream_options={"include_usage": True},
        )
        r = httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=60)
        body.update(stream=False, logprobs=True, stream_options=None)
        whole = httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=60)
        scrape = httpx.get(f"{gw}/metrics").text
    assert r.status_code == 200 and whole.status_code == 200, (r.text, whole.text)
    chunks = [
        json.loads(m.removeprefix("data: "))
        for m in r.text.split("\n\n")
        if m.startswith("data: {")
    ]
    assert {c["model"] for c in chunks} == {"gw-tiny"}  # the upstream's "tiny" renamed
    assert {ch["index"] for c in chunks for ch in c["choices"]} == {0, 1}
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    answer = whole.json()
    assert answer["model"] == "gw-tiny" and len(answer["choices"]) == 2
    assert all(len(c["logprobs"]["content"]) == 4 for c in answer["choices"])
    assert 'vlmserve_output_tokens_total{model="gw-tiny"} 16.0' in scrape  # 8 + 8, from usage


def test_cancel_by_completion_id_reaches_the_worker_holding_a_passed_stream(
    gateway: str, workers: list[ServerProcess]
) -> None:
    body = chat(stream=True, max_tokens=20000, ignore_eos=True)
    with httpx.Client(timeout=60) as client:
        events, r = read_events(
            client, "POST", f"{gateway}/v1/chat/completions", json=body, limit=3
        )
        assert r.status_code == 200 and in_flight(workers) == 1
        completion_id, sid = events[0].json["id"], r.headers["x-session-id"]
        r = client.post(f"{gateway}/v1/chat/completions/{completion_id}/cancel")
        assert r.status_code == 200 and r.json()["cancelled"] is True, r.text
        held = [client.get(f"{w.url}/v1/streams/{sid}").status_code for w in workers]
        assert sorted(held) == [200, 404]  # the worker's own session, ended by the cancel
    deadline = time.monotonic() + 15
    while in_flight(workers):
        assert time.monotonic() < deadline, "the worker still generates after the cancel"
        time.sleep(0.1)


def test_a_workers_4xx_reaches_the_client_of_a_passed_stream(gateway: str) -> None:
    r = httpx.post(
        f"{gateway}/v1/chat/completions", json=chat(stream=True, max_tokens=-5), timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"
    part = {"type": ["image_url"], "image_url": {"url": "data:"}}  # a list is no part type
    body = chat(stream=True, messages=[{"role": "user", "content": [part]}])
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_without_passthrough_the_gateway_runs_its_own_session(
    workers: list[ServerProcess], tmp_path: Path
) -> None:
    with gateway_over(workers, tmp_path, gateway_passthrough=False) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=chat(stream=True), timeout=60)
        sid = r.headers["x-session-id"]
        replay = httpx.get(f"{gw}/v1/streams/{sid}", timeout=60).text
        assert data_lines(replay) == data_lines(r.text)
    assert [httpx.get(f"{w.url}/v1/streams/{sid}").status_code for w in workers] == [404, 404]


def test_two_keys_stay_apart_through_a_gateway_that_holds_its_own_worker_key(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """The worker knows one key, the gateway's; the gateway keeps its clients' keys apart:
    another key's resume or cancel of a passed stream is an unknown id's 404."""
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"]
    keyed = ServerProcess(args, env={"VLMSERVE_API_KEYS": '["wk-own"]'})
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    try:
        keyed.wait_ready()
        assert httpx.post(f"{keyed.url}/v1/chat/completions", json=chat()).status_code == 401
        with (
            gateway_over(
                [keyed], tmp_path, upstream='api_key = "wk-own"\n', api_keys=["key-a", "key-b"]
            ) as gw,
            httpx.Client(timeout=60) as client,
        ):
            body = chat(stream=True, max_tokens=20000, ignore_eos=True)
            url = f"{gw}/v1/chat/completions"
            first, r = read_events(client, "POST", url, json=body, headers=a, limit=2)
            assert r.status_code == 200, r.text
            sid, cid = r.headers["x-session-id"], first[0].json["id"]
            assert cid.startswith("chatcmpl-")
            for name in (sid, cid):
                for method, path in (
                    ("GET", "/v1/streams/{}"),
                    ("POST", "/v1/chat/completions/{}/cancel"),
                    ("POST", "/v1/cancel/{}"),
                ):
                    unknown = client.request(method, gw + path.format("s-unknown"), headers=b)
                    theirs = client.request(method, gw + path.format(name), headers=b)
                    assert theirs.status_code == unknown.status_code == 404, theirs.text
                    assert theirs.text.replace(name, "s-unknown") == unknown.text
            more, r = read_events(
                client,
                "GET",
                f"{gw}/v1/streams/{sid}",
                headers={**a, "Last-Event-ID": first[-1].id},
                limit=2,
            )
            assert r.status_code == 200 and [e.index for e in more] == [2, 3]
            r = client.post(f"{gw}/v1/chat/completions/{cid}/cancel", headers=a)
            assert r.status_code == 200 and r.json()["cancelled"] is True, r.text  # still live
    finally:
        keyed.stop()


def test_vllm_backend_runs_and_stops_its_subprocess(tiny_dir: Path, tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "vlmserve.cli.main",
        "serve",
        "--model",
        str(tiny_dir),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--port",
        "{port}",
    ]
    reg = registry(
        tmp_path / "registry.toml",
        f'[[models]]\nname = "tiny-vllm"\nserved_model_id = "tiny"\nbackend = "vllm"\n'
        f"[models.backend_config]\ncommand = {json.dumps(command)}\n"
        f'log_dir = "{tmp_path}"\nhealth_timeout = 120\n',
    )
    with LiveServer(build_app(gateway_settings(reg, load_on_startup=False))) as gw:
        r = httpx.post(
            f"{gw.url}/admin/activate", json={"model": "tiny-vllm"}, headers=ADMIN, timeout=150
        )
        assert r.status_code == 200, r.text
        process = r.json()["upstream"]["process"]
        family = [psutil.Process(process["pid"])]
        family += family[0].children(recursive=True)
        body = chat(model="tiny-vllm")
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tiny-vllm"
        r = httpx.post(
            f"{gw.url}/admin/deactivate", json={"model": "tiny-vllm"}, headers=ADMIN, timeout=60
        )
        assert r.json()["state"] == "unloaded"
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)
    assert (tmp_path / "tiny-vllm.log").stat().st_size > 0


def test_killed_worker_gets_no_traffic_and_both_down_is_503(
    gateway: str, workers: list[ServerProcess]
) -> None:
    dead, alive = workers
    dead.proc.kill()
    dead.proc.wait()
    before = replicas(gateway)[dead.url]["requests"]
    for _ in range(6):  # before detection a request may hit it: retried on the other worker
        r = httpx.post(f"{gateway}/v1/chat/completions", json=chat(), timeout=60)
        assert r.status_code == 200, r.text
    state = replicas(gateway)
    assert state[dead.url]["requests"] <= before + 1
    assert state[dead.url]["healthy"] is False or state[dead.url]["ejected_for_seconds"]
    alive.proc.kill()
    alive.proc.wait()
    r = httpx.post(f"{gateway}/v1/chat/completions", json=chat(), timeout=60)
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "upstream_unavailable"
