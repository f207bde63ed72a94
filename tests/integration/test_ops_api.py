"""Auth, metrics and the idle watchdog on the real app (not just the libraries)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import MODEL
from vlmserve.testing.media import data_url, image_bytes

KEYS = {"api_keys": ["user-key"], "admin_keys": ["admin-key"]}
USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}


def chat() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }


async def raw_get(client: httpx.AsyncClient, raw_path: str, headers: dict[str, str]) -> int:
    """Send a path exactly as written (httpx would normalise some of these)."""
    url = httpx.URL("http://vlmserve.test").copy_with(raw_path=raw_path.encode())
    return (await client.get(url, headers=headers)).status_code


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models",
        "//v1/models",
        "/V1/models",
        "/v1/models/",
        "/%761/models",
        "/./v1/models",
        "/admin/state",
        "//admin/state",
        "/ADMIN/state",
        "/admin/state/",
        "/v1/../admin/state",
        "/v1/%2e%2e/admin/state",
        "/%61dmin/state",
    ],
)
async def test_every_protected_route_is_401_without_a_key(make_client: Any, path: str) -> None:
    client = await make_client(**KEYS)
    assert await raw_get(client, path, {}) == 401
    assert await raw_get(client, path, {"Authorization": "Bearer wrong"}) == 401


@pytest.mark.parametrize(
    "path", ["/admin/state", "//admin/state", "/ADMIN/state", "/v1/../admin/state", "/admin/state/"]
)
async def test_admin_routes_reject_the_plain_api_key(make_client: Any, path: str) -> None:
    client = await make_client(**KEYS)
    assert await raw_get(client, path, USER) == 401
    assert (await client.get("/admin/state", headers=ADMIN)).status_code == 200


async def test_keys_open_their_routes_and_health_stays_public(make_client: Any) -> None:
    client = await make_client(**KEYS)
    assert (await client.get("/health")).status_code == 200
    assert (await client.post("/v1/chat/completions", json=chat(), headers=USER)).status_code == 200
    assert (await client.post("/v1/chat/completions", json=chat())).status_code == 401


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_move_when_requests_are_served(make_client: Any) -> None:
    client = await make_client()
    before = samples((await client.get("/metrics")).text)
    assert (await client.post("/v1/chat/completions", json=chat())).status_code == 200
    png = image_bytes(32, 32)
    content = [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}}]
    with_image = {**chat(), "messages": [{"role": "user", "content": content}]}
    assert (await client.post("/v1/chat/completions", json=with_image)).status_code == 200
    after = samples((await client.get("/metrics")).text)
    route = ("route", "/v1/chat/completions")
    requests = [k for k in after if k[0] == "vlmserve_requests_total" and route in k[1]]
    served = sum(after[k] for k in requests) - sum(before.get(k, 0) for k in requests)
    assert requests and served == 2
    assert all(("model", MODEL) in k[1] for k in requests)
    tokens = [k for k in after if k[0] == "vlmserve_output_tokens_total"]
    assert tokens and after[tokens[0]] >= before.get(tokens[0], 0) + 1
    names = {k[0] for k in after}
    for series in (
        "vlmserve_time_to_first_token_seconds_count",
        "vlmserve_model_state",
        "vlmserve_model_load_seconds",
        "vlmserve_requests_in_flight",
    ):
        assert series in names, series
    media = [k for k in after if k[0] == "vlmserve_media_bytes_total" and ("kind", "image") in k[1]]
    assert media and after[media[0]] - before.get(media[0], 0) == len(png)
    ready = [k for k in after if k[0] == "vlmserve_model_state" and ("state", "ready") in k[1]]
    assert after[ready[0]] == 1


async def test_idle_command_runs_once_after_idle_and_deregisters_first(
    make_client: Any, tmp_path: Path
) -> None:
    order = tmp_path / "order.txt"
    script = tmp_path / "mark.py"
    script.write_text(
        "import sys, pathlib\n"
        f"p = pathlib.Path({str(order)!r})\n"
        "p.write_text(p.read_text() + sys.argv[1] + '\\n' if p.exists() else sys.argv[1] + '\\n')\n"
    )
    client = await make_client(
        idle_seconds=0.4,
        idle_check_interval=0.05,
        idle_command=[sys.executable, str(script), "shutdown"],
        deregister_command=[sys.executable, str(script), "deregister"],
        activity_file=str(tmp_path / "activity"),
    )
    assert (await client.post("/v1/chat/completions", json=chat())).status_code == 200
    await asyncio.sleep(0.2)
    assert not order.exists()  # not idle long enough yet
    for _ in range(100):
        if order.exists() and "shutdown" in order.read_text():
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert order.read_text().split() == ["deregister", "shutdown"]  # once, hook first
    assert (tmp_path / "activity").exists()


def test_idle_command_waits_for_a_stream_that_outlives_its_request(
    live_server: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "shutdown"
    server = live_server(
        idle_seconds=0.3,
        idle_check_interval=0.05,
        idle_command=[sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"],
    )
    body = {**chat(), "max_tokens": 3500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as response:
            next(response.iter_lines())
            sid = response.headers["x-session-id"]
        time.sleep(1.0)  # the client is gone, the generation (a model lease) goes on
        assert not marker.exists()
        assert c.post(f"/v1/cancel/{sid}").status_code == 200
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "x"
