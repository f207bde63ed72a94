"""vlmserve on Ray Serve against vlmserve alone: scale-out ratio and per-request overhead.

    python benchmarks/ray_serve.py                       # c=1 and c=8, 2 interleaved rounds
    python benchmarks/ray_serve.py --rounds 3 --json ray_serve.json

Four setups on the same tiny checkpoint, driven by the same client (streamed image requests of
a fixed length, ``vlmserve.client.loadtest``):

- ``serve``: ``vlmserve serve`` (the baseline);
- ``gateway``: a vlmserve gateway whose registry has one ``openai`` entry pointing at ``serve``;
- ``ray-1``: the Ray Serve application (``vlmserve.ray_serve.app``) with 1 ingress replica and 1
  model replica, on a local Ray cluster started here;
- ``ray-2``: the same application with 2 model replicas (deployed beside ``ray-1`` under
  another route prefix).

Reported: output tokens/s of ``ray-2`` over ``ray-1`` at each concurrency (rounds of load
tests, interleaved; on a 2-core machine this says more about overhead than about speed-up:
both replicas share the same cores), and the TTFT p50 that Ray Serve adds over ``serve``
against what the gateway adds (budget: at most 2x the gateway's), from one-at-a-time
requests that take turns between the setups request by request (``--ttft-requests``).
Requires the ``ray`` extra. Ray's own tuning switches reach the local cluster from the
environment, e.g. ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1 python benchmarks/ray_serve.py``;
``--direct-ingress`` sends the Ray setups' requests to their ingress replicas' own ports
(Ray Serve's direct ingress) instead of through Ray's HTTP proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.servers import SERVED_NAME, Server, ServerSpec, free_ports, vlmserve_spec
from peers.ttft import interleaved_ttft

SERVE, GATEWAY, RAY_1, RAY_2 = "serve", "gateway", "ray-1", "ray-2"
SETUPS = (SERVE, GATEWAY, RAY_1, RAY_2)
OVERHEAD_BUDGET = 2.0  # Ray's TTFT overhead at c=1 over the gateway's, at most


def _gateway_spec(model_dir: str, port: int, worker_url: str, work: Path) -> ServerSpec:
    registry = work / "registry.toml"
    registry.write_text(
        f'[[models]]\nname = "{SERVED_NAME}"\nbackend = "openai"\n'
        f'roles = ["chat"]\n[models.backend_config]\n'
        f'base_urls = ["{worker_url}"]\n'
    )
    spec = vlmserve_spec(model_dir, port, "float32")
    at = spec.argv.index("--model")
    del spec.argv[at : at + 4]  # no local model: --model DIR --served-model-name NAME
    spec.argv += ["--registry", str(registry)]
    spec.name = GATEWAY
    return spec


def _ray_config(model_dir: str, work: Path) -> Path:
    path = work / "vlmserve-ray.toml"
    path.write_text(
        f'device = "cpu"\ndtype = "float32"\nlog_level = "warning"\n'
        f'[[models]]\nname = "{SERVED_NAME}"\nsource = "{model_dir}"\n'
        f"[ray]\ningress_replicas = 1\ningress_num_cpus = 0\n"
        f"[ray.models.{SERVED_NAME}]\nnum_replicas = 1\nnum_cpus = 0\n"
    )
    return path


def start_ray(model_dir: str, port: int, work: Path, direct: bool) -> dict[str, str]:
    """A local Ray cluster with two applications: 1 and 2 model replicas. Their base URLs:
    through Ray's HTTP proxy, or (``direct``) each app's ingress replica's own port."""
    import ray
    from ray import serve

    from vlmserve.ray_serve.app import build_application, ingress_urls
    from vlmserve.ray_serve.config import load_ray_setup

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    urls = {}
    for name, replicas in ((RAY_1, 1), (RAY_2, 2)):
        setup = load_ray_setup(_ray_config(model_dir, work))
        setup.ray.models[SERVED_NAME].num_replicas = replicas
        serve.run(build_application(setup), name=name, route_prefix=f"/{name}")
        urls[name] = (
            _direct_url(ingress_urls, name) if direct else f"http://127.0.0.1:{port}/{name}"
        )
    return urls


def _direct_url(ingress_urls: Any, name: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not (found := ingress_urls(name, "127.0.0.1")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: no ingress replica port after {timeout:.0f}s")
        time.sleep(0.5)
    return found[0]


def measure(url: str, ns: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    from vlmserve.client.loadtest import LoadConfig, run_load

    requests = ns.requests or max(8, 2 * concurrency)
    load = LoadConfig(
        base_url=url,
        model=SERVED_NAME,
        concurrency=concurrency,
        requests=requests,
        image=(64, 64),
        max_tokens=ns.max_tokens,
        prompt_words=32,
        ignore_eos=True,
    )
    return asyncio.run(run_load(load)).to_dict()


def run(ns: argparse.Namespace, model_dir: str, work: Path) -> list[dict[str, Any]]:
    """Every (round, concurrency, setup) measurement, setups in a rotating order."""
    ports = free_ports(3)
    serve_spec = vlmserve_spec(model_dir, ports[0], "float32")
    serve_spec.name = SERVE
    servers = [
        Server(serve_spec, work),
        Server(_gateway_spec(model_dir, ports[1], serve_spec.url, work), work),
    ]
    samples: list[dict[str, Any]] = []
    try:
        for server in servers:
            server.start(180)
        urls = {SERVE: serve_spec.url, GATEWAY: servers[1].spec.url}
        urls |= start_ray(model_dir, ports[2], work, ns.direct_ingress)
        for url in urls.values():  # warm-up: enough requests to reach every replica
            measure(url, ns, 8)
        for rnd in range(ns.rounds):
            for c in ns.concurrency:
                order = SETUPS[rnd % 4 :] + SETUPS[: rnd % 4]
                for setup in order:
                    report = measure(urls[setup], ns, c)
                    samples.append({"round": rnd, "concurrency": c, "setup": setup, **report})
                    print(
                        f"round {rnd + 1} c={c:<3} {setup:<8} "
                        f"{report['output_throughput']:8.1f} tok/s  TTFT p50 "
                        f"{report['ttft_ms']['median']:7.1f} ms  failed {report['failed']}",
                        flush=True,
                    )
        ttft = asyncio.run(interleaved_ttft(urls, ns.ttft_requests, SERVED_NAME))
        samples.append({"setup": "interleaved", "ttft_ms": ttft})
    finally:
        for server in servers:
            server.stop()
        _stop_ray()
    return samples


def _stop_ray() -> None:
    try:
        import ray
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    except ImportError:
        pass


def summarize(samples: list[dict[str, Any]], concurrencies: list[int]) -> dict[str, Any]:
    """Medians over rounds, the 2-vs-1 ratio and the overhead budget."""
    med: dict[tuple[str, int], dict[str, float]] = {}
    for setup in SETUPS:
        for c in concurrencies:
            rows = [s for s in samples if s["setup"] == setup and s.get("concurrency") == c]
            med[setup, c] = {
                "tok_s": statistics.median(r["output_throughput"] for r in rows),
                "ttft_p50_ms": statistics.median(r["ttft_ms"]["median"] for r in rows),
                "failed": sum(r["failed"] for r in rows),
            }
    ratios = {c: med[RAY_2, c]["tok_s"] / med[RAY_1, c]["tok_s"] for c in concurrencies}
    ttft = next(s["ttft_ms"] for s in samples if s["setup"] == "interleaved")
    base = statistics.median(ttft[SERVE])
    gateway_ms = statistics.median(ttft[GATEWAY]) - base
    ray_ms = statistics.median(ttft[RAY_1]) - base
    ok = ray_ms <= OVERHEAD_BUDGET * max(gateway_ms, 0.0)
    return {
        "medians": {f"{s}@c={c}": v for (s, c), v in med.items()},
        "throughput_ratio_2_vs_1": {f"c={c}": r for c, r in ratios.items()},
        "ttft_overhead_ms": {
            "concurrency": 1,
            "serve_p50": base,
            "gateway": gateway_ms,
            "ray_serve": ray_ms,
            "ratio": ray_ms / gateway_ms if gateway_ms > 0 else None,
            "budget": OVERHEAD_BUDGET,
            "holds": ok,
        },
    }


def _print(summary: dict[str, Any]) -> None:
    print("\nsetup@concurrency       out tok/s   TTFT p50 ms   failed")
    for key, v in summary["medians"].items():
        print(f"{key:<22} {v['tok_s']:10.1f} {v['ttft_p50_ms']:13.1f} {v['failed']:8d}")
    for key, r in summary["throughput_ratio_2_vs_1"].items():
        print(f"throughput ray-2 / ray-1 at {key}: {r:.2f}x")
    o = summary["ttft_overhead_ms"]
    ratio = "n/a" if o["ratio"] is None else f"{o['ratio']:.1f}x"
    print(
        f"TTFT p50 added at c={o['concurrency']}: gateway {o['gateway']:+.1f} ms, Ray Serve "
        f"{o['ray_serve']:+.1f} ms ({ratio} the gateway's; budget {o['budget']:g}x: "
        f"{'holds' if o['holds'] else 'DOES NOT HOLD'})"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint dir (default: the tiny random-weight Qwen2-VL)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=0, help="per measurement (0: 2 x conc, >= 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--ttft-requests",
        type=int,
        default=60,
        help="one-at-a-time requests per setup for the TTFT overhead",
    )
    p.add_argument(
        "--direct-ingress",
        action="store_true",
        help="Ray Serve's direct ingress: requests go to the ingress replicas' own ports, "
        "not through Ray's HTTP proxy (vlmserve ray serve --direct-ingress)",
    )
    p.add_argument("--json", dest="json_path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.direct_ingress:  # before Ray starts: its processes read it then
        from vlmserve.ray_serve.config import DIRECT_INGRESS_ENV

        os.environ[DIRECT_INGRESS_ENV] = "1"
    model_dir = ns.model
    if not model_dir:
        from vlmserve.testing import build_qwen2_vl

        model_dir = str(build_qwen2_vl())
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vlmserve-ray-bench-") as work:
        samples = run(ns, model_dir, Path(work))
    summary = summarize(samples, list(dict.fromkeys(ns.concurrency)))
    _print(summary)
    print(f"(whole run: {time.monotonic() - began:.0f}s)")
    if ns.json_path:
        Path(ns.json_path).write_text(
            json.dumps({"summary": summary, "samples": samples}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
