"""Does a text request notice other users' pictures? Text TTFT idle, under an image flood and
under a text flood of the same request rate and prompt length; image requests/s; peak RSS.

    python benchmarks/media_load.py --peer vllm                 # vlmserve (workers 0 1 2) + vLLM
    python benchmarks/media_load.py --media-workers 0 2 --seconds 20 --runs 3
    python benchmarks/media_load.py --pool-only --media-workers 1 2   # the worker pool alone

Per server: ``--probes`` streamed text requests one at a time, idle; then ``--clients`` loops
sending never-repeated 1280x960 JPEGs (``max_tokens`` 1) for ``--seconds`` while the probes
run; then the same number of loops sending text whose prompt has the image request's token
count, paced to the image flood's request rate (the loops take turns, as the unpaced image
loops fall into doing, rather than sending in bursts), with the probes again. Each flood
runs in a process of its own (as other users' clients would), so the probes' event loop
times the server, not the flood's uploads (``--same-process-flood`` puts it back in the
probes' loop).
Peak RSS is the sum of VmHWM over the server's process group, reset before each flood.
Results: a row per server and run, then per server the medians over the runs (each run's
image/text-flood and image/idle ratios, then their median; ``--media-workers 2``'s image
requests/s over ``0``'s), and ``--out`` JSON (the runs). ``--pool-only`` decodes data-URL
JPEGs in ``MediaPool(n)`` (no model, no HTTP): images/s for each worker count (0 = a thread
of this process).

``--controls`` adds floods at the image flood's request rate that each keep one part of an
image request and drop the rest, to tell what a text request waits for under the image
flood: ``text-photo-body`` (the text flood's prompts in request bodies as large as a
photo's, the padding in the OpenAI ``user`` field: the body's upload, read and parse alone)
and ``same-photo`` (one photo sent again and again: the decode, the hand-offs between the
server's processes and threads and the request's own answer, with the processor, vision
and prefix caches hit). Each prints its TTFT p50 over the text flood's.

``--phases`` (vlmserve only) asks each probe for its timings (``include_metrics``) and prints
where its time to first token went, p50 ms per phase: ``media`` (arrival until the engine
may start: body, template, tokenizer), ``queue``, ``vision``, ``prefill``, and ``other``
(the client's TTFT less those four: HTTP both ways and the hops between the server's
processes).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.servers import Server, ServerSpec, free_ports, vllm_spec, vlmserve_spec
from peers.settle import wait_idle

PEERS_DIR = Path.home() / ".cache" / "vlmserve" / "peers"
SIZE = (1280, 960)


def photos(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct 1280x960 JPEG data URLs (a gradient with a random 40x30 mosaic on it:
    photo-sized files, ~150 KB, none equal to another)."""
    rng = random.Random(seed)
    base = Image.linear_gradient("L").resize(SIZE).convert("RGB")
    out = []
    for _ in range(n):
        mosaic = Image.frombytes("RGB", (40, 30), rng.randbytes(40 * 30 * 3)).resize(SIZE)
        buf = io.BytesIO()
        Image.blend(base, mosaic, 0.5).save(buf, format="JPEG", quality=90)
        out.append("data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


def image_body(model: str, url: str) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}


def padded(body: dict[str, Any], size: int) -> dict[str, Any]:
    """``body`` grown to ``size`` bytes of JSON by a ``user`` string (OpenAI's end-user id:
    the server takes it and the answer does not depend on it)."""
    bare = {**body, "user": ""}
    return {**body, "user": "u" * max(0, size - len(json.dumps(bare)))}


def text_body(model: str, words: int, stream: bool = False) -> dict[str, Any]:
    text = " ".join(random.choice(("red", "green", "blue", "sky")) for _ in range(words))
    body = {"model": model, "max_tokens": 2 if stream else 1, "stream": stream}
    return {**body, "messages": [{"role": "user", "content": text}]}


PHASES = ("media", "queue", "vision", "prefill")
METRICS = {"media": "media_ms", "queue": "queue_time_ms", "vision": "vision_ms"}


class Probes(list[float]):
    """Probe TTFTs (ms), and with ``--phases`` each probe's server timings (``metrics``)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[float, dict[str, Any]]] = []


async def probe(client: httpx.AsyncClient, model: str, n: int, phases: bool = False) -> Probes:
    """TTFT (ms) of ``n`` streamed text requests, one at a time."""
    times = Probes()
    for _ in range(n):
        body = text_body(model, 8, True)
        if phases:
            body |= {"include_metrics": True, "stream_options": {"include_usage": True}}
        began, first, metrics = time.perf_counter(), None, None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = (time.perf_counter() - began) * 1000
                if phases and '"metrics"' in line and line.startswith("data: "):
                    metrics = json.loads(line[6:]).get("metrics")
        if first is not None:
            times.append(first)
            if metrics:
                times.metrics.append((first, metrics))
        await asyncio.sleep(0.02)
    return times


def phase_p50(probes: list[tuple[float, dict[str, Any]]]) -> dict[str, float]:
    """p50 ms of each phase of the probes' TTFT (``PHASES``, then ``other``: the rest)."""
    if not probes:
        return {}
    rows = []
    for ttft, metrics in probes:
        row = {name: float(metrics.get(METRICS.get(name, f"{name}_ms")) or 0.0) for name in PHASES}
        rows.append({**row, "other": ttft - sum(row.values())})
    return {name: statistics.median(r[name] for r in rows) for name in (*PHASES, "other")}


async def flood(
    client: httpx.AsyncClient, bodies: Any, clients: int, stop: asyncio.Event, rate: float = 0
) -> int:
    """``clients`` loops posting ``next(bodies)`` until ``stop`` (or ``bodies`` runs out: more
    ``--images`` needed, said on stderr); at most ``rate`` requests/s in all when given, the
    loops' requests spread evenly over each interval (started together, they would arrive
    in bursts of ``clients``, a harsher load than the unpaced flood's). -> requests
    answered 200."""
    done = 0
    interval = clients / rate if rate else 0.0

    async def loop(index: int) -> None:
        nonlocal done
        await asyncio.sleep(index * interval / clients)
        while not stop.is_set():
            body = next(bodies, None)
            if body is None:
                print("the distinct images ran out: pass a larger --images", file=sys.stderr)
                stop.set()
                return
            began = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=body)
            done += r.status_code == 200
            await asyncio.sleep(max(0.0, interval - (time.perf_counter() - began)))

    await asyncio.gather(*(loop(i) for i in range(clients)))
    return done


def group_hwm_mib(pid: int) -> tuple[float, list[int]]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    total = 0
    for p in procs:
        with open(f"/proc/{p.pid}/status") as f:
            total += next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
    return total / 1024, [p.pid for p in procs]


def reset_peaks(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")


async def under_flood(
    client: httpx.AsyncClient, model: str, bodies: Any, args: argparse.Namespace, rate: float
) -> tuple[Probes, float]:
    """Probe TTFTs while ``bodies`` flood the server from this event loop; -> (TTFTs, flood
    requests/s)."""
    stop = asyncio.Event()
    began = time.perf_counter()
    flooding = asyncio.create_task(flood(client, bodies, args.clients, stop, rate))
    await asyncio.sleep(1.0)  # the flood is on
    ttfts = await probe(client, model, args.probes, args.phases)
    if flooding.done() or stop.is_set():
        print("the flood ended before the probes did: pass a larger --images", file=sys.stderr)
    await asyncio.wait([flooding], timeout=max(0.0, args.seconds - (time.perf_counter() - began)))
    stop.set()
    done = await flooding
    return ttfts, done / (time.perf_counter() - began)  # over the flood's own time


async def under_child_flood(
    client: httpx.AsyncClient, model: str, plan: dict[str, Any], args: argparse.Namespace
) -> tuple[Probes, float]:
    """Probe TTFTs while a child process (``--flood-child``) floods the server as ``plan``
    says; -> (TTFTs, flood requests/s). The child makes its bodies first, then floods from
    "go" until "stop" (or ``--seconds``)."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--flood-child", json.dumps(plan)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        if (await asyncio.to_thread(child.stdout.readline)).strip() != "ready":
            raise RuntimeError("the flood process did not start (see its stderr above)")
        _say(child, "go")
        began = time.perf_counter()
        await asyncio.sleep(1.0)  # the flood is on
        ttfts = await probe(client, model, args.probes, args.phases)
        await asyncio.sleep(max(0.0, args.seconds - (time.perf_counter() - began)))
        with contextlib.suppress(BrokenPipeError):  # it ran out of bodies and is gone
            _say(child, "stop")
        line = await asyncio.to_thread(child.stdout.readline)
        if not line:
            raise RuntimeError("the flood process ended without its count (see its stderr)")
        result = json.loads(line)
    finally:
        try:
            await asyncio.to_thread(child.wait, 30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if result["ran_out"]:
        print("the flood ended before the probes did: pass a larger --images", file=sys.stderr)
    return ttfts, result["done"] / result["seconds"]


CONTROLS = ("text-photo-body", "same-photo")


def flood_bodies(model: str, kind: str, images: int, seed: int, tokens: int) -> Iterator[Any]:
    """A flood's request bodies: ``image``: ``images`` never-repeated photos; ``text``:
    endless text prompts of ``tokens`` words; ``CONTROLS``: those prompts in photo-sized
    bodies, or one photo (of ``seed``) again and again."""
    if kind == "image":
        return iter(image_body(model, u) for u in photos(images, seed=seed))
    if kind == "same-photo":
        body = image_body(model, photos(1, seed=seed)[0])
        return iter(lambda: body, None)
    if kind == "text-photo-body":
        size = len(json.dumps(image_body(model, photos(1, seed=seed)[0])))
        return iter(lambda: padded(text_body(model, tokens), size), None)
    if kind != "text":
        raise ValueError(f"no flood of kind {kind!r}")
    return iter(lambda: text_body(model, tokens), None)


def _say(child: subprocess.Popen[str], word: str) -> None:
    assert child.stdin is not None
    child.stdin.write(word + "\n")
    child.stdin.flush()


def flood_child(plan: dict[str, Any]) -> None:
    """``--flood-child``: make the plan's bodies, say "ready", flood from "go" until "stop",
    then print ``{"done", "seconds", "ran_out"}`` as one JSON line."""
    bodies = flood_bodies(plan["model"], plan["kind"], plan["images"], plan["seed"], plan["tokens"])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return

    async def run() -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        waiting = loop.run_in_executor(None, sys.stdin.readline)
        waiting.add_done_callback(lambda _: loop.call_soon_threadsafe(stop.set))
        began = time.perf_counter()
        async with httpx.AsyncClient(base_url=plan["url"], timeout=300) as client:
            done = await flood(client, bodies, plan["clients"], stop, plan["rate"])
        seconds = time.perf_counter() - began
        ran_out = not waiting.done()  # stopped before the parent said so: bodies ran out
        return {"done": done, "seconds": seconds, "ran_out": ran_out}

    result = asyncio.run(run())
    print(json.dumps(result), flush=True)
    os._exit(0)  # the stdin reader thread may still wait


async def measure(spec: ServerSpec, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    # the warm-up image comes from another seed than the flood's: none is ever sent twice
    warm = image_body(spec.model, photos(1, seed=args.seed + 1_000_003)[0])
    async with httpx.AsyncClient(base_url=spec.url, timeout=300) as client:
        r = await client.post("/v1/chat/completions", json=warm)
        r.raise_for_status()
        tokens = r.json()["usage"]["prompt_tokens"]
        phases = args.phases and spec.name.startswith("vlmserve")
        idle = await probe(client, spec.model, args.probes, phases)
        _, pids = group_hwm_mib(pid)
        reset_peaks(pids)
        flood_args = argparse.Namespace(**{**vars(args), "phases": phases})
        plan = {"url": spec.url, "model": spec.model, "clients": args.clients}
        plan |= {"images": args.images, "seed": args.seed, "tokens": tokens}

        async def flooded_by(kind: str, rate: float) -> tuple[Probes, float]:
            if not args.same_process_flood:
                kind_plan = {**plan, "kind": kind, "rate": rate}
                return await under_child_flood(client, spec.model, kind_plan, flood_args)
            bodies = flood_bodies(spec.model, kind, args.images, args.seed, tokens)
            return await under_flood(client, spec.model, bodies, flood_args, rate)

        flooded, image_rate = await flooded_by("image", 0.0)
        peak, _ = group_hwm_mib(pid)
        wait_idle(args.settle)
        text_flooded, text_rate = await flooded_by("text", image_rate)
        controls = {}
        for kind in args.controls:
            wait_idle(args.settle)
            controls[kind], _ = await flooded_by(kind, image_rate)
    conditions = {"idle": idle, "image_flood": flooded, "text_flood": text_flooded, **controls}
    return {
        "server": spec.name,
        "prompt_tokens": tokens,
        "idle": idle,
        "image_flood": flooded,
        "text_flood": text_flooded,
        "controls": controls,
        "image_rps": image_rate,
        "text_rps": text_rate,
        "peak_rss_mib": peak,
        "phases": {k: phase_p50(v.metrics) for k, v in conditions.items()} if phases else {},
    }


def specs(args: argparse.Namespace, model_dir: str) -> list[ServerSpec]:
    out = []
    ports = free_ports(len(args.media_workers) + 1)
    for workers, port in zip(args.media_workers, ports, strict=False):
        spec = vlmserve_spec(model_dir, port, "float32")
        spec.argv += ["--media-workers", str(workers)]
        spec.name = f"vlmserve-w{workers}"
        out.append(spec)
    if args.peer == "vllm":
        out.append(vllm_spec(model_dir, ports[-1], "float32", args.peers_dir))
    return out


def run_servers(args: argparse.Namespace) -> list[dict[str, Any]]:
    from vlmserve.testing.tiny import build_qwen2_vl

    model_dir = str(build_qwen2_vl())
    log_dir = Path(tempfile.mkdtemp(prefix="media-load-"))
    results = []
    for _ in range(args.runs):
        for spec in specs(args, model_dir):
            if spec.missing:
                print(f"{spec.name}: not installed: {spec.missing}")
                continue
            server = Server(spec, log_dir)
            try:
                server.start(args.startup_timeout)
                wait_idle(args.settle)
                assert server.proc is not None
                results.append(asyncio.run(measure(spec, server.proc.pid, args)))
            finally:
                server.stop()
    return results


def pool_only(args: argparse.Namespace) -> list[dict[str, Any]]:
    from vlmserve.media import MediaPolicy, decode_image, read_source
    from vlmserve.media.workers import MediaPool, read_and_decode

    policy, urls = MediaPolicy(), photos(args.images, seed=args.seed)

    async def one(workers: int) -> dict[str, Any]:
        pool = MediaPool(workers) if workers else None
        if pool is not None:
            await pool.start()

        async def decode(url: str) -> None:
            if pool is not None:
                await pool.run(read_and_decode, url, policy, "image", decode_image, policy)
            else:
                await asyncio.to_thread(
                    decode_image, await read_source(url, policy, kind="image"), policy
                )

        began, queue = time.perf_counter(), iter(urls)

        async def worker() -> None:
            for url in queue:
                await decode(url)

        await asyncio.gather(*(worker() for _ in range(max(2, 2 * workers))))
        seconds = time.perf_counter() - began
        if pool is not None:
            pool.close()
        return {
            "server": f"pool-w{workers}",
            "images": len(urls),
            "images_per_s": len(urls) / seconds,
        }

    return [asyncio.run(one(w)) for w in args.media_workers]


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def medians(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per server, the median over its runs of each run's figures: text TTFT p50 idle and
    under each flood, the image flood's p50 over the text flood's and over idle (each run's
    own ratio, then their median), image requests/s and peak RSS."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault(r["server"], []).append(r)
    out = []
    for server, rs in runs.items():
        p50 = {k: [p(r[k], 50) for r in rs] for k in ("idle", "image_flood", "text_flood")}
        out.append(
            {
                "server": server,
                "runs": len(rs),
                **{k: statistics.median(v) for k, v in p50.items()},
                "image_vs_text": statistics.median(
                    i / t for i, t in zip(p50["image_flood"], p50["text_flood"], strict=True)
                ),
                "image_vs_idle": statistics.median(
                    i / t for i, t in zip(p50["image_flood"], p50["idle"], strict=True)
                ),
                "controls_vs_text": {
                    kind: statistics.median(
                        p(r["controls"][kind], 50) / t
                        for r, t in zip(rs, p50["text_flood"], strict=True)
                    )
                    for kind in rs[0].get("controls") or {}
                },
                "image_rps": statistics.median(r["image_rps"] for r in rs),
                "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
            }
        )
    return out


def report_medians(rows: list[dict[str, Any]]) -> None:
    """The medians table, and the issue's comparisons: image/text flood <= 1.2x, image/idle
    <= 1.5x, and ``--media-workers 2``'s image requests/s against ``0``'s."""
    if not rows:
        return
    print(f"\nmedians of {max(r['runs'] for r in rows)} run(s), text TTFT p50 ms:")
    print("server            idle  image flood  text flood  image/text  image/idle   img/s")
    for r in rows:
        print(
            f"{r['server']:<16} {r['idle']:5.1f}  {r['image_flood']:11.1f}  {r['text_flood']:10.1f}"
            f"  {r['image_vs_text']:9.2f}x  {r['image_vs_idle']:9.2f}x  {r['image_rps']:6.1f}"
        )
    for r in rows:
        for kind, ratio in r.get("controls_vs_text", {}).items():
            print(f"{r['server']:<16} {kind} flood / text flood: {ratio:.2f}x")
    rps = {r["server"]: r["image_rps"] for r in rows}
    if "vlmserve-w0" in rps and "vlmserve-w2" in rps:
        ratio = rps["vlmserve-w2"] / rps["vlmserve-w0"]
        print(f"image requests/s, --media-workers 2 over 0: {ratio:.2f}x")


def report(results: list[dict[str, Any]]) -> None:
    if results and "images_per_s" in results[0]:
        for r in results:
            print(f"{r['server']:>12}  {r['images_per_s']:7.1f} images/s  ({r['images']} images)")
        return
    head = "server            idle p50/p90    image flood p50/p90   text flood p50/p90"
    print(head + "   img/s  txt/s  peak RSS MiB")
    for r in results:
        cells = [
            f"{p(r[k], 50):6.1f}/{p(r[k], 90):6.1f}" for k in ("idle", "image_flood", "text_flood")
        ]
        print(
            f"{r['server']:<16}  {cells[0]:>14}  {cells[1]:>20}  {cells[2]:>18}"
            f"  {r['image_rps']:6.1f} {r['text_rps']:6.1f}  {r['peak_rss_mib']:8.0f}"
        )
    for r in results:
        for kind, ttfts in (r.get("controls") or {}).items():
            cells = f"{p(ttfts, 50):6.1f}/{p(ttfts, 90):6.1f}"
            print(f"{r['server']:<16}  {kind} flood p50/p90 {cells}")
    for r in results:
        for condition, phases in (r.get("phases") or {}).items():
            cells = "  ".join(f"{name} {ms:5.1f}" for name, ms in phases.items())
            print(f"{r['server']:<16}  {condition:<12} TTFT p50 by phase, ms: {cells}")
    report_medians(medians(results))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--peer", choices=["vllm"], help="also measure vLLM on the same checkpoint")
    ap.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    ap.add_argument("--media-workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pool-only", action="store_true", help="the worker pool alone, no model")
    ap.add_argument("--clients", type=int, default=4, help="flood loops")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each flood")
    ap.add_argument("--probes", type=int, default=40, help="text TTFT probes per phase")
    ap.add_argument("--images", type=int, default=1000, help="distinct JPEGs made up front")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument(
        "--phases", action="store_true", help="vlmserve: where each probe's TTFT went (p50 ms)"
    )
    ap.add_argument(
        "--controls",
        nargs="*",
        choices=CONTROLS,
        default=[],
        help="more floods at the image flood's rate, each keeping one part of an image "
        "request: its body's size, or one photo again and again (caches hit)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=10.0, help="max seconds to wait for idle CPUs")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument(
        "--same-process-flood",
        action="store_true",
        help="send the floods from the probes' own event loop (not a process of their own)",
    )
    ap.add_argument("--flood-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood_child:
        flood_child(json.loads(args.flood_child))
        return
    results = pool_only(args) if args.pool_only else run_servers(args)
    report(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
