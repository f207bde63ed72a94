"""Where a proxy's time to first token goes: the request's way in, and the first token's way out.

    python benchmarks/hops.py                       # 3 rounds of 300 requests per setup
    python benchmarks/hops.py --rounds 5 --requests 500

No model: the upstream is ``peers/stamping_worker.py``, which says it is a vlmserve worker and
stamps its one content chunk with when the request reached it and when the chunk left it
(``time.monotonic_ns``, the machine's clock). The client sends one streamed image request at
a time, taking turns between the setups (the order rotating), and reports per setup, as
medians:

- **request path**: from the client starting its request to the worker having its head
  (the client's own request-building cost is in every setup alike);
- **first-token path**: from the worker sending the content chunk to the client reading it.

Setups: ``direct`` (the worker alone); ``gateway`` (vlmserve over it: the byte pass-through);
``gateway-sessions`` (the same with ``VLMSERVE_GATEWAY_PASSTHROUGH=false``: its own session and
re-encoding); ``byteproxy`` (``peers/byteproxy.py``: uvicorn + aiohttp forwarding bytes, the
floor of a Python proxy). With nothing else running, what a setup adds over ``direct`` is its
own software path; ``benchmarks/overhead.py`` measures the same proxies in front of a real
model, where they also wait for cores the engine holds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.servers import SERVED_NAME, Server, ServerSpec, free_ports, vlmserve_cmd
from peers.stamping_worker import stamps
from peers.ttft import _body

__all__ = ["hop_specs", "main", "one_request"]

PEERS = Path(__file__).resolve().parent / "peers"
Paths = dict[str, dict[str, list[float]]]  # setup -> "request"/"first token" -> ms


def hop_specs(ports: list[int], work: Path) -> list[ServerSpec]:
    """The stamping worker, and the proxies in front of it."""
    up = f"http://127.0.0.1:{ports[0]}"
    uvicorn = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(PEERS),
        "--http",
        "httptools",
        "--host",
        "127.0.0.1",
        "--log-level",
        "warning",
    ]
    registry = work / "registry.toml"
    registry.write_text(
        f'[[models]]\nname = "{SERVED_NAME}"\nbackend = "openai"\nroles = ["chat"]\n'
        f'[models.backend_config]\nbase_urls = ["{up}"]\npreflight = false\n'
    )
    gateway = [
        *vlmserve_cmd(),
        "serve",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--log-level",
        "warning",
        "--registry",
        str(registry),
        "--port",
    ]
    direct = [*uvicorn, "stamping_worker:app", "--port", str(ports[0])]
    proxy = [*uvicorn, "byteproxy:app", "--port", str(ports[3])]
    off = {"VLMSERVE_GATEWAY_PASSTHROUGH": "false"}
    return [
        ServerSpec("direct", direct, ports[0], SERVED_NAME),
        ServerSpec("gateway", [*gateway, str(ports[1])], ports[1], SERVED_NAME),
        ServerSpec("gateway-sessions", [*gateway, str(ports[2])], ports[2], SERVED_NAME, env=off),
        ServerSpec("byteproxy", proxy, ports[3], SERVED_NAME, env={"BYTEPROXY_UPSTREAM": up}),
    ]


async def one_request(client: httpx.AsyncClient, body: dict[str, object]) -> tuple[float, float]:
    """(request path, first-token path) in ms of one streamed request, read to its end."""
    began = time.monotonic_ns()
    found: tuple[int, int] | None = None
    read, lines = 0, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            lines.append(line)
            if found is None and (found := stamps(line)) is not None:
                read = time.monotonic_ns()
    if found is None:
        raise RuntimeError(f"no stamped chunk in the answer: {response.status_code} {lines[:3]}")
    arrived, sent = found
    return (arrived - began) / 1e6, (read - sent) / 1e6


async def one_round(urls: dict[str, str], n: int) -> Paths:
    body = _body(SERVED_NAME)
    clients = {s: httpx.AsyncClient(base_url=u, timeout=30) for s, u in urls.items()}
    paths: Paths = {s: {"request": [], "first token": []} for s in urls}
    names = list(urls)
    try:
        for i in range(n):
            for setup in names[i % len(names) :] + names[: i % len(names)]:
                request, first = await one_request(clients[setup], body)
                paths[setup]["request"].append(request)
                paths[setup]["first token"].append(first)
    finally:
        for client in clients.values():
            await client.aclose()
    return paths


def table(rounds: list[Paths]) -> Table:
    out = Table(title="medians per round (ms); + over direct")
    out.add_column("setup")
    for what in ("request", "first token"):
        out.add_column(f"{what} path", justify="right")
    for setup in rounds[0]:
        cells = []
        for what in ("request", "first token"):
            ours = [statistics.median(r[setup][what]) for r in rounds]
            base = [statistics.median(r["direct"][what]) for r in rounds]
            added = " / ".join(f"{o - b:+.2f}" for o, b in zip(ours, base, strict=True))
            cells.append(
                " / ".join(f"{o:.2f}" for o in ours) + ("" if setup == "direct" else f"  ({added})")
            )
        out.add_row(setup, *cells)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=300, help="per setup and round")
    ns = p.parse_args(argv)
    console = Console()
    servers: list[Server] = []
    with tempfile.TemporaryDirectory(prefix="vlmserve-hops-") as work:
        try:
            for spec in hop_specs(free_ports(4), Path(work)):
                server = Server(spec, Path(work) / "logs")
                server.start(timeout=120)
                servers.append(server)
            urls = {s.spec.name: s.spec.url for s in servers}
            asyncio.run(one_round(urls, 20))  # warm-up: connections, the gateway's first pass
            rounds = []
            for r in range(ns.rounds):
                rounds.append(asyncio.run(one_round(urls, ns.requests)))
                console.print(f"round {r + 1}/{ns.rounds} done")
        finally:
            for server in servers:
                server.stop()
    console.print(table(rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
