"""`vlmserve preflight`: passes on a healthy server, names the failing check on a text-only one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from support import LiveServer, free_port, make_settings
from vlmserve.api.app import build_app
from vlmserve.cli.main import app as cli
from vlmserve.client.preflight import PreflightReport, run_preflight
from vlmserve.config import Settings
from vlmserve.registry.manager import ModelManager
from vlmserve.testing import build_lora_adapter


def text_only_registry(tmp: Path, tiny_dir: Path) -> Path:
    path = tmp / "registry.toml"
    path.write_text(f'''
[[models]]
name = "text-only"
source = "{tiny_dir}"
roles = ["chat"]

[models.capabilities]
vision = false
''')
    return path


@pytest.fixture(scope="module")
def text_only_models(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    registry = text_only_registry(tmp_path_factory.mktemp("reg"), tiny_dir)
    settings = Settings(registry=str(registry), device="cpu", engine_process=False)
    manager = ModelManager.from_settings(settings)
    for handle in manager.handles:
        handle.backend.load()
    yield settings, manager
    manager.close()


async def preflight_in_process(app_: object, **kwargs: object) -> PreflightReport:
    async with app_.router.lifespan_context(app_):  # type: ignore[attr-defined]
        transport = httpx.ASGITransport(app=app_)  # type: ignore[arg-type]
        return await run_preflight("http://vlmserve.test/v1/", transport=transport, **kwargs)  # type: ignore[arg-type]


async def test_a_healthy_server_passes_every_check(
    tiny_dir: Path, chat_models: ModelManager
) -> None:
    report = await preflight_in_process(build_app(make_settings(tiny_dir), models=chat_models))
    assert report.ok, report.to_dict()
    assert report.url == "http://vlmserve.test" and report.model == "tiny"  # first listed
    by_name = {c.name: c for c in report.checks}
    assert [c.name for c in report.checks] == ["models", "text_chat", "vision_chat", "embeddings"]
    assert by_name["text_chat"].ok and by_name["vision_chat"].ok
    assert by_name["vision_chat"].latency_ms > 0
    assert by_name["embeddings"].ok is None and "no embedding" in by_name["embeddings"].detail


async def test_a_text_only_model_fails_the_vision_check(text_only_models: tuple) -> None:
    settings, models = text_only_models
    report = await preflight_in_process(build_app(settings, models=models), model="text-only")
    assert not report.ok and report.failed == ["vision_chat"]
    vision = next(c for c in report.checks if c.name == "vision_chat")
    assert "HTTP 400" in vision.detail and "model_capability_missing" in vision.detail
    assert report.to_dict()["checks"][1]["status"] == "ok"  # text chat still fine


async def test_an_unlisted_model_fails_the_models_check_and_names_what_is_listed(
    tiny_dir: Path, chat_models: ModelManager
) -> None:
    app_ = build_app(make_settings(tiny_dir), models=chat_models)
    report = await preflight_in_process(app_, model="gpt-9")
    models = report.checks[0]
    assert (
        models.ok is False and "'gpt-9' is not listed" in models.detail and "tiny" in models.detail
    )
    assert "text_chat" in report.failed  # the server says 404 too, with the reason
    assert "404" in report.checks[1].detail


async def test_an_embedding_model_gets_the_embeddings_check(tiny_dir: Path) -> None:
    entry = {
        "name": "tiny-vlm2vec",
        "source": str(tiny_dir),
        "adapter": str(build_lora_adapter(tiny_dir)),
        "roles": ["embedding"],
    }
    settings = Settings(models=[entry], device="cpu")
    models = ModelManager.from_settings(settings)
    try:
        for handle in models.handles:
            handle.backend.load()
        report = await preflight_in_process(build_app(settings, models=models))
    finally:
        models.close()
    by_name = {c.name: c for c in report.checks}
    assert report.ok, report.to_dict()
    assert by_name["embeddings"].ok is True and by_name["embeddings"].detail == "dimension 128"
    assert by_name["text_chat"].ok is None and "embedding-only" in by_name["text_chat"].detail


async def test_an_api_key_is_sent_and_a_wrong_one_is_explained(
    tiny_dir: Path, chat_models: ModelManager
) -> None:
    app_ = build_app(make_settings(tiny_dir, api_keys=["sesame"]), models=chat_models)
    assert (await preflight_in_process(app_, api_key="sesame")).ok
    report = await preflight_in_process(app_, api_key="wrong")
    assert report.failed[0] == "models" and "401" in report.checks[0].detail
    assert "--api-key" in report.checks[0].detail


async def test_an_unreachable_server_fails_once_and_skips_the_rest() -> None:
    report = await run_preflight(f"http://127.0.0.1:{free_port()}", "tiny", timeout=5)
    assert report.failed == ["models"] and "cannot connect" in report.checks[0].detail
    assert all(c.ok is None for c in report.checks[1:])


def test_cli_exits_1_naming_the_failing_check(text_only_models: tuple) -> None:
    settings, models = text_only_models
    with LiveServer(build_app(settings, models=models)) as server:
        result = CliRunner().invoke(cli, ["preflight", server.url, "--model", "text-only"])
        as_json = CliRunner().invoke(cli, ["preflight", server.url, "--json"])
    assert result.exit_code == 1, result.output
    assert "vision_chat" in result.output and "FAIL" in result.output
    assert as_json.exit_code == 1
    parsed = json.loads(as_json.stdout)
    assert parsed["ok"] is False and parsed["failed"] == ["vision_chat"]
    assert parsed["model"] == "text-only"


def test_cli_json_report_parses_and_exits_0_when_healthy(live_server: object) -> None:
    server = live_server()  # type: ignore[operator]
    result = CliRunner().invoke(cli, ["preflight", server.url, "--json", "--timeout", "60"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["model"] == "tiny"
    assert [c["status"] for c in report["checks"]] == ["ok", "ok", "ok", "skip"]
