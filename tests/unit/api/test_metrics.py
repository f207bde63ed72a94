"""Metrics: private registry per app, request counts by route template, in-flight, /metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import Response

from vlmserve.api.metrics import Metrics, MetricsMiddleware, metrics_endpoint


def build() -> tuple[FastAPI, Metrics, asyncio.Event]:
    metrics = Metrics()
    release = asyncio.Event()
    app = FastAPI()

    @app.get("/v1/streams/{session_id}")
    async def stream(session_id: str, request: Request) -> StreamingResponse:
        request.state.model = "tiny"

        async def body():
            yield b"data: 1\n\n"
            await release.wait()
            yield b"data: 2\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict:
        if name == "missing":
            raise HTTPException(404, "no such model")
        return {"id": name}

    @app.get("/metrics")
    async def scrape() -> Response:
        return metrics_endpoint(metrics)

    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app, metrics, release


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


async def scrape(c: httpx.AsyncClient) -> str:
    r = await c.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return r.text


async def test_requests_are_counted_by_route_template_and_status() -> None:
    app, _, _ = build()
    async with client(app) as c:
        before = await scrape(c)
        for name in ("a", "b", "missing"):
            await c.get(f"/v1/models/{name}")
        await c.get("/nowhere")
        after = await scrape(c)
    route = "/v1/models/{name}"
    assert value(before, "vlmserve_requests_total", route=route, model="", status="200") == 0
    assert value(after, "vlmserve_requests_total", route=route, model="", status="200") == 2
    assert value(after, "vlmserve_requests_total", route=route, model="", status="404") == 1
    assert value(after, "vlmserve_requests_total", route="unmatched", model="", status="404") == 1
    assert not any("/v1/models/a" in str(labels) for _, labels in samples(after))


async def test_in_flight_counts_a_running_stream_and_returns_to_zero() -> None:
    app, _, release = build()
    route = "/v1/streams/{session_id}"
    async with client(app) as c:
        # ASGITransport buffers the whole body, so the stream runs as a task we hold open
        streaming = asyncio.create_task(c.get("/v1/streams/abc123"))
        await asyncio.sleep(0.05)
        during = await scrape(c)
        release.set()
        r = await asyncio.wait_for(streaming, 5)
        after = await scrape(c)
    assert r.text == "data: 1\n\ndata: 2\n\n"
    assert value(during, "vlmserve_requests_in_flight", route=route) == 1
    assert value(after, "vlmserve_requests_in_flight", route=route) == 0
    assert value(after, "vlmserve_requests_total", route=route, model="tiny", status="200") == 1


async def test_an_exception_counts_as_500_and_in_flight_still_returns() -> None:
    metrics = Metrics()

    async def broken(scope, receive, send) -> None:
        raise RuntimeError("boom")

    app = MetricsMiddleware(broken, metrics)
    scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
    with pytest.raises(RuntimeError):
        await app(scope, None, None)  # type: ignore[arg-type]
    text = metrics.render().decode()
    assert value(text, "vlmserve_requests_total", route="unmatched", model="", status="500") == 1
    assert value(text, "vlmserve_requests_in_flight", route="unmatched") == 0


async def test_two_apps_do_not_share_state() -> None:
    app1, _, _ = build()
    app2, _, _ = build()
    async with client(app1) as c1, client(app2) as c2:
        await c1.get("/v1/models/a")
        text2 = await scrape(c2)
        text1 = await scrape(c1)
    route = "/v1/models/{name}"
    assert value(text1, "vlmserve_requests_total", route=route, model="", status="200") == 1
    assert value(text2, "vlmserve_requests_total", route=route, model="", status="200") == 0


def test_engine_side_series_move() -> None:
    m = Metrics()
    m.set_load("tiny", running=2, waiting=3, usage=0.25)
    m.observe_generation("tiny", prompt_tokens=10, output_tokens=5, ttft=0.2, total=1.0)
    m.set_model_state("tiny", "loading")
    m.set_model_state("tiny", "ready")
    m.set_model_load_seconds("tiny", 4.5)
    m.observe_media("image", 1000)
    m.observe_media("video", 5000, frames=8)
    m.set_vision_cache("tiny", {"hits": 1, "misses": 1, "bytes": 4096})
    text = m.render().decode()
    assert value(text, "vlmserve_queue_depth", model="tiny") == 3
    assert value(text, "vlmserve_num_requests_waiting", model="tiny") == 3
    assert value(text, "vlmserve_num_requests_running", model="tiny") == 2
    assert value(text, "vlmserve_kv_cache_usage_ratio", model="tiny") == 0.25
    assert value(text, "vllm:num_requests_waiting", model_name="tiny", engine="0") == 3
    assert value(text, "vllm:num_requests_running", model_name="tiny", engine="0") == 2
    assert value(text, "vllm:kv_cache_usage_perc", model_name="tiny", engine="0") == 0.25
    assert value(text, "vlmserve_prompt_tokens_total", model="tiny") == 10
    assert value(text, "vlmserve_output_tokens_total", model="tiny") == 5
    assert value(text, "vlmserve_time_to_first_token_seconds_count", model="tiny") == 1
    assert value(text, "vlmserve_time_to_first_token_seconds_sum", model="tiny") == 0.2
    assert value(text, "vlmserve_generation_tokens_per_second_sum", model="tiny") == 5.0
    assert value(text, "vlmserve_time_per_output_token_seconds_sum", model="tiny") == 0.2
    assert value(text, "vlmserve_model_state", model="tiny", state="ready") == 1
    assert value(text, "vlmserve_model_state", model="tiny", state="loading") == 0
    assert value(text, "vlmserve_model_load_seconds", model="tiny") == 4.5
    assert value(text, "vlmserve_media_bytes_total", kind="video") == 5000
    assert value(text, "vlmserve_media_frames_total") == 8
    assert value(text, "vlmserve_vision_cache_hits_total", model="tiny") == 1
    assert value(text, "vlmserve_vision_cache_misses_total", model="tiny") == 1
    assert value(text, "vlmserve_vision_cache_bytes", model="tiny") == 4096


def test_vision_cache_counters_follow_the_engine_across_scrapes_and_reloads() -> None:
    m = Metrics()
    m.set_vision_cache("tiny", {"hits": 3, "misses": 2, "bytes": 10})
    m.set_vision_cache("tiny", {"hits": 5, "misses": 2, "bytes": 20})  # two more hits
    m.set_vision_cache("tiny", {"hits": 1, "misses": 1, "bytes": 5})  # reloaded: counts anew
    text = m.render().decode()
    assert value(text, "vlmserve_vision_cache_hits_total", model="tiny") == 6
    assert value(text, "vlmserve_vision_cache_misses_total", model="tiny") == 3
    assert value(text, "vlmserve_vision_cache_bytes", model="tiny") == 5


def test_the_remembered_route_templates_are_per_app_and_only_for_static_paths() -> None:
    from fastapi import FastAPI

    from vlmserve.api import metrics_http

    def app_with(*paths: str) -> FastAPI:
        app = FastAPI()
        for path in paths:
            app.add_api_route(path, lambda: None, methods=["GET"])
        return app

    one, other = app_with("/a", "/items/{item_id}"), app_with("/b")

    def template(app: FastAPI, path: str, method: str = "GET") -> str:
        scope = {"type": "http", "app": app, "method": method, "path": path, "root_path": ""}
        return metrics_http._template_before_routing(scope)

    assert [template(one, "/a"), template(one, "/a")] == ["/a", "/a"]
    assert template(other, "/a") == metrics_http.UNMATCHED  # another app: its own routes
    assert template(one, "/items/7") == "/items/{item_id}"
    assert metrics_http._STATIC[one] == {("GET", "/a"): "/a"}  # no concrete ids remembered
    assert template(one, "/a", "POST") == "/a"  # a partial match (wrong method): the 405s
    assert ("POST", "/a") in metrics_http._STATIC[one]


def test_remembered_label_children_count_right_and_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vlmserve.api import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "_MAX_CHILDREN", 3)
    m = Metrics()
    for i in range(10):  # more label values than it remembers: counted all the same
        route = f"/r{i % 5}"
        m.request_started(route)
        m.request_finished(
            route=route, in_flight_route=route, model="tiny", status=200, seconds=0.01
        )
        m.observe_ttft("tiny", 0.1)
    text = m.render().decode()
    assert len(m._children) <= 3
    for i in range(5):
        assert (
            value(text, "vlmserve_requests_total", route=f"/r{i}", model="tiny", status="200") == 2
        )
        assert value(text, "vlmserve_requests_in_flight", route=f"/r{i}") == 0
    assert value(text, "vlmserve_time_to_first_token_seconds_count", model="tiny") == 10
