"""Ray Serve's own floor: the time to the first streamed byte through Ray's hops, no model.

    python benchmarks/ray_floor.py                 # 3 rounds of 100 requests per setup
    python benchmarks/ray_floor.py --rounds 5 --requests 200 --json ray_floor.json

Issue 21 budgets the TTFT that vlmserve on Ray Serve adds at c=1 to at most 2x what the
built-in gateway adds. This measures what Ray itself costs on this machine, whatever runs in
it: the same bare ASGI app (one streamed SSE answer of 5 events, no model, no vlmserve code)

- ``uvicorn``: served by uvicorn (httptools), the baseline;
- ``ray-proxy``: as a Ray Serve ingress deployment, reached through Ray's HTTP proxy (the hop
  every Ray Serve request takes);
- ``ray-handle``: the same ingress passing the stream through a ``DeploymentHandle`` streaming
  call to a second deployment (the hop vlmserve's ingress takes to its model replicas).

One local Ray cluster, ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` (as ``vlmserve ray serve`` sets).
Requests take turns between the setups one by one; the table has each round's TTFT p50 and
what each Ray setup adds over uvicorn. Requires the ``ray`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.servers import free_ports

EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]


async def sse_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The bare app: drain the body, answer 5 SSE events."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for event in EVENTS:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def start_uvicorn(port: int) -> subprocess.Popen[bytes]:
    """uvicorn serving ``sse_app`` in its own process (as Ray's proxy and replicas are)."""
    argv = [
        sys.executable,
        "-m",
        "uvicorn",
        "ray_floor:sse_app",
        "--app-dir",
        str(Path(__file__).resolve().parent),
        "--port",
        str(port),
        "--http",
        "httptools",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("uvicorn did not start")


def start_ray(port: int) -> dict[str, str]:
    """Two Ray Serve applications: the app alone, and the app behind a streaming handle."""
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    import ray
    from fastapi import FastAPI
    from ray import serve
    from starlette.responses import StreamingResponse

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Source:
        async def stream(self) -> Any:
            for event in EVENTS:
                yield event

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Ingress:
        def __init__(self, source: Any = None):
            self.source = source.options(stream=True) if source is not None else None

        @api.post("/v1/chat/completions")
        async def chat(self):  # type: ignore[no-untyped-def]  (no annotation: FastAPI reads it)
            if self.source is None:
                return StreamingResponse(iter(EVENTS), media_type="text/event-stream")
            return StreamingResponse(self.source.stream.remote(), media_type="text/event-stream")

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Ingress.bind(), name="proxy", route_prefix="/proxy")
    serve.run(Ingress.bind(Source.bind()), name="handle", route_prefix="/handle")
    base = f"http://127.0.0.1:{port}"
    return {"ray-proxy": f"{base}/proxy", "ray-handle": f"{base}/handle"}


async def ttft(urls: dict[str, str], requests: int) -> dict[str, float]:
    """TTFT p50 (ms) per setup; the setups take turns request by request."""
    import aiohttp

    body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    times: dict[str, list[float]] = {name: [] for name in urls}
    async with aiohttp.ClientSession() as session:
        for i in range(requests + 10):
            for name, url in urls.items():
                began = time.perf_counter()
                first = None
                async with session.post(url + "/v1/chat/completions", data=body) as response:
                    async for _ in response.content.iter_any():
                        first = first or time.perf_counter() - began
                if i >= 10 and first is not None:  # the first 10: warm-up
                    times[name].append(first * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=100, help="per setup and round")
    p.add_argument("--json", dest="json_path")
    ns = p.parse_args(argv)
    try:
        import ray
    except ImportError:
        print('needs the ray extra: pip install -e ".[ray]"', file=sys.stderr)
        return 2
    uvicorn_port, ray_port = free_ports(2)
    baseline = start_uvicorn(uvicorn_port)
    rounds = []
    try:
        urls = {"uvicorn": f"http://127.0.0.1:{uvicorn_port}", **start_ray(ray_port)}
        for r in range(ns.rounds):
            p50 = asyncio.run(ttft(urls, ns.requests))
            rounds.append(p50)
            added = "  ".join(
                f"{k} +{v - p50['uvicorn']:.2f} ms" for k, v in p50.items() if k != "uvicorn"
            )
            print(f"round {r + 1}: uvicorn TTFT p50 {p50['uvicorn']:.2f} ms  {added}", flush=True)
    finally:
        baseline.terminate()
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    if ns.json_path:
        Path(ns.json_path).write_text(json.dumps({"rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
