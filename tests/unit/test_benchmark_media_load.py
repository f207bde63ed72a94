"""benchmarks/media_load.py plumbing at its smallest: distinct photo-sized JPEGs, and the
worker pool measured alone (no model, no HTTP)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import time
from types import ModuleType
from typing import Any

import httpx
import pytest
from PIL import Image

from support import import_benchmark


def load() -> ModuleType:
    return import_benchmark("media_load.py")


def test_the_flood_images_are_distinct_1280x960_jpegs() -> None:
    urls = load().photos(3)
    assert len(set(urls)) == 3
    data = base64.b64decode(urls[0].split(",", 1)[1])
    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.size) == ("JPEG", (1280, 960))


def test_the_control_floods_keep_a_photo_requests_body_size_or_its_one_photo() -> None:
    bench = load()
    photo = bench.image_body("m", bench.photos(1, seed=7)[0])
    padded = list(itertools.islice(bench.flood_bodies("m", "text-photo-body", 0, 7, 20), 2))
    assert all(abs(len(json.dumps(b)) - len(json.dumps(photo))) <= 2 for b in padded)
    assert all(isinstance(b["messages"][0]["content"], str) for b in padded)  # no image
    assert len(padded[0]["messages"][0]["content"].split()) == 20
    same = list(itertools.islice(bench.flood_bodies("m", "same-photo", 0, 7, 20), 3))
    assert same == [photo] * 3
    with pytest.raises(ValueError, match="no flood of kind 'video'"):
        bench.flood_bodies("m", "video", 0, 7, 20)


def test_pool_only_reports_images_per_second_for_each_worker_count() -> None:
    bench = load()
    args = argparse.Namespace(media_workers=[0, 1], images=4, seed=0)
    results = bench.pool_only(args)
    assert [r["server"] for r in results] == ["pool-w0", "pool-w1"]
    assert all(r["images"] == 4 and r["images_per_s"] > 0 for r in results)


def test_phases_split_each_probes_ttft_and_the_rest_is_other() -> None:
    bench = load()
    probes = [
        (20.0, {"media_ms": 5.0, "queue_time_ms": 1.0, "vision_ms": 0.0, "prefill_ms": 4.0}),
        (40.0, {"media_ms": 9.0, "queue_time_ms": 3.0, "vision_ms": 0.0, "prefill_ms": 8.0}),
        (30.0, {"media_ms": 7.0, "queue_time_ms": 2.0, "vision_ms": None, "prefill_ms": 6.0}),
    ]
    phases = bench.phase_p50(probes)
    assert phases == {
        "media": 7.0,
        "queue": 2.0,
        "vision": 0.0,
        "prefill": 6.0,
        "other": 15.0,  # 10, 20, 15: each probe's TTFT less its four phases
    }
    assert bench.phase_p50([]) == {}


def test_medians_take_each_runs_own_ratios_then_their_median(capsys) -> None:
    bench = load()

    def run(server: str, idle: float, image: float, text: float, rps: float) -> dict[str, Any]:
        return {
            "server": server,
            "idle": [idle] * 3,
            "image_flood": [image] * 3,
            "text_flood": [text] * 3,
            "image_rps": rps,
            "text_rps": rps,
            "peak_rss_mib": 100.0,
        }

    results = [
        run("vlmserve-w0", 10.0, 30.0, 10.0, 40.0),
        run("vlmserve-w2", 10.0, 12.0, 10.0, 44.0),
        run("vlmserve-w0", 10.0, 20.0, 20.0, 50.0),
        run("vlmserve-w2", 20.0, 20.0, 10.0, 46.0),
        run("vlmserve-w0", 10.0, 25.0, 5.0, 45.0),
        run("vlmserve-w2", 10.0, 15.0, 10.0, 42.0),
    ]
    rows = {r["server"]: r for r in bench.medians(results)}
    w0, w2 = rows["vlmserve-w0"], rows["vlmserve-w2"]
    assert w0["runs"] == 3 and (w0["idle"], w0["image_flood"], w0["text_flood"]) == (10, 25, 10)
    assert w0["image_vs_text"] == 3.0  # runs: 3.0, 1.0, 5.0 (not 25 / 10)
    assert w2["image_vs_idle"] == 1.2  # runs: 1.2, 1.0, 1.5
    assert (w0["image_rps"], w2["image_rps"]) == (45.0, 44.0)
    bench.report(results)
    assert "--media-workers 2 over 0: 0.98x" in capsys.readouterr().out


def test_each_control_flood_is_set_against_its_own_runs_text_flood(capsys) -> None:
    bench = load()

    def run(text: float, same: float) -> dict[str, Any]:
        return {
            "server": "vlmserve-w1",
            "idle": [10.0],
            "image_flood": [20.0],
            "text_flood": [text],
            "controls": {"same-photo": [same]},
            "image_rps": 40.0,
            "text_rps": 40.0,
            "peak_rss_mib": 100.0,
        }

    rows = bench.medians([run(10.0, 15.0), run(20.0, 20.0), run(5.0, 10.0)])
    assert rows[0]["controls_vs_text"] == {"same-photo": 1.5}  # runs 1.5, 1.0, 2.0
    bench.report([run(10.0, 15.0)])
    out = capsys.readouterr().out
    assert "same-photo flood p50/p90   15.0/  15.0" in out
    assert "same-photo flood / text flood: 1.50x" in out


async def test_probes_with_phases_carry_the_servers_timings(live_server) -> None:
    import httpx

    from support import MODEL

    server = live_server()
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        plain = await load().probe(client, MODEL, 2)
        timed = await load().probe(client, MODEL, 2, phases=True)
    assert len(plain) == len(timed) == 2 and not plain.metrics
    assert [ttft for ttft, _ in timed.metrics] == list(timed)
    for _, metrics in timed.metrics:
        assert {"media_ms", "queue_time_ms", "vision_ms", "prefill_ms"} <= metrics.keys()
    phases = load().phase_p50(timed.metrics)
    assert phases["prefill"] > 0 and phases["media"] > 0


async def _child_flood(live_server, probes: int, seconds: float, **plan: Any) -> tuple:
    """``under_child_flood`` against a live tiny server with ``plan``'s kind, count and rate."""
    import httpx

    from support import MODEL

    server = live_server()
    args = argparse.Namespace(probes=probes, phases=False, seconds=seconds)
    plan = {"url": server.url, "model": MODEL, "clients": 2, "seed": 0, **plan}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        return await load().under_child_flood(client, MODEL, plan, args)


async def test_a_flood_from_its_own_process_is_paced_and_the_probes_still_run(
    live_server,
) -> None:
    plan = {"kind": "text", "tokens": 12, "images": 0, "rate": 10.0}
    ttfts, rate = await _child_flood(live_server, 3, 2.0, **plan)
    assert len(ttfts) == 3 and all(t > 0 for t in ttfts)
    assert 3.0 <= rate <= 11.0  # paced to 10 requests/s, answered by the server


async def test_a_photo_sized_text_body_is_answered_as_the_text_is(live_server) -> None:
    plan = {"kind": "text-photo-body", "tokens": 12, "images": 0, "rate": 10.0}
    ttfts, rate = await _child_flood(live_server, 2, 2.0, **plan)
    assert len(ttfts) == 2
    assert rate >= 3.0  # each padded request answered 200: the padding is taken as it is


async def test_a_flood_that_runs_out_of_images_says_so(live_server, capsys) -> None:
    plan = {"kind": "image", "tokens": 0, "images": 2, "rate": 0.0}
    ttfts, rate = await _child_flood(live_server, 1, 3.0, **plan)
    assert len(ttfts) == 1 and rate > 0
    assert "pass a larger --images" in capsys.readouterr().err


async def test_a_paced_floods_loops_send_in_turn_not_in_bursts() -> None:
    bench = load()
    sent: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(time.perf_counter())
        return httpx.Response(200, json={})

    stop = asyncio.Event()
    transport = httpx.MockTransport(answer)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        task = asyncio.create_task(bench.flood(client, iter(lambda: {}, None), 4, stop, 16.0))
        await asyncio.sleep(0.6)  # 4 loops at 16/s in all: one request each 62.5 ms
        stop.set()
        assert await task == len(sent)
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert len(sent) >= 8
    assert min(gaps[:8]) > 0.01, gaps  # started together, 3 of every 4 gaps would be ~0
