"""`vlmserve serve` flags reach the settings the server is built from, and its help fits."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from vlmserve.cli import main, serve
from vlmserve.config import Settings


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    seen: list[Settings] = []
    monkeypatch.setattr(serve, "run", seen.append)
    return seen


def _serve(*args: str, **env: str) -> Any:
    return CliRunner().invoke(main.app, ["serve", *args], env=env or None)


def _serve_params() -> list[Any]:
    """The serve command's parameters (click's, or the copy of click typer ships)."""
    return typer.main.get_command(main.app).commands["serve"].params  # type: ignore[attr-defined]


def test_every_serve_flag_reaches_the_settings(captured: list[Settings], tmp_path: Path) -> None:
    registry = tmp_path / "registry.toml"
    result = _serve(
        "--model",
        "some/model",
        "--attn-implementation",
        "sdpa",
        "--min-pixels",
        "3136",
        "--max-pixels",
        "50176",
        "--max-video-frames",
        "4",
        "--trust-remote-code",
        "--log-level",
        "debug",
        "--registry",
        str(registry),
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        "512",
        "--vision-cache-bytes",
        "0",
        "--stream-interval",
        "2",
        "--max-queued-requests",
        "7",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--processor-cache-bytes",
        "1024",
        "--served-model-name",
        "m",
        "--host",
        "0.0.0.0",
        "--port",
        "9",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-model-len",
        "77",
        "--admin-key",
        "a1",
        "--cors-allow-origins",
        "http://a.test",
        "--max-tokens",
        "11",
        "--temperature",
        "0.1",
        "--max-body-bytes",
        "12",
        "--max-media-per-request",
        "2",
        "--max-media-bytes",
        "13",
        "--max-image-pixels",
        "14",
        "--allowed-local-media-path",
        "/srv/media",
        "--lazy-load",
        "--keep-alive",
        "15",
        "--max-loaded-models",
        "3",
        "--persist-sessions",
        "--redis-url",
        "redis://r:6379/0",
        "--no-ui",
        "--no-engine-process",
        "--no-warmup",
        "--liveness-timeout",
        "45",
    )
    assert result.exit_code == 0, result.output
    s = captured[0]
    assert (s.attn_implementation, s.min_pixels, s.max_pixels) == ("sdpa", 3136, 50176)
    assert (s.max_video_frames, s.trust_remote_code, s.log_level) == (4, True, "debug")
    assert s.registry == str(registry)
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.vision_cache_bytes) == (1, 512, 0)
    assert s.max_queued_requests == 7 and s.stream_interval == 2
    assert s.processor_cache_bytes == 1024
    assert s.api_keys == ["k1", "k2"] and s.admin_keys == ["a1"]
    assert (s.model, s.served_model_name, s.host, s.port) == ("some/model", "m", "0.0.0.0", 9)
    assert (s.device, s.dtype, s.max_model_len) == ("cpu", "float32", 77)
    assert s.engine_process is False
    assert s.cors_allow_origins == ["http://a.test"]
    assert (s.max_tokens, s.temperature, s.max_body_bytes) == (11, 0.1, 12)
    assert (s.max_media_per_request, s.max_media_bytes, s.max_image_pixels) == (2, 13, 14)
    assert s.allowed_local_media_path == ["/srv/media"]
    assert (s.load_on_startup, s.keep_alive, s.max_loaded_models) == (False, 15, 3)
    assert s.persist_sessions is True and s.redis_url == "redis://r:6379/0"
    assert s.ui is False
    assert s.warmup is False and s.liveness_timeout == 45
    assert s.exit_on_load_failure is True


def test_unset_flags_keep_the_defaults(captured: list[Settings]) -> None:
    assert _serve("--model", "some/model").exit_code == 0
    defaults = Settings()
    assert captured[0].max_num_seqs == defaults.max_num_seqs
    assert captured[0].api_keys == [] and captured[0].admin_keys == []
    assert captured[0].cors_allow_origins == []
    assert captured[0].load_on_startup is True and captured[0].trust_remote_code is False
    assert captured[0].ui is True and captured[0].engine_process is True
    assert captured[0].warmup is True and captured[0].liveness_timeout == 300


def test_unset_flags_leave_the_environment_in_force(captured: list[Settings]) -> None:
    env = {"VLMSERVE_CORS_ALLOW_ORIGINS": '["http://env.test"]', "VLMSERVE_MAX_TOKENS": "5"}
    assert _serve("--model", "m", **env).exit_code == 0
    assert captured[0].cors_allow_origins == ["http://env.test"]
    assert captured[0].max_tokens == 5


def test_cors_origins_are_repeatable_and_comma_lists(captured: list[Settings]) -> None:
    result = _serve(
        "--model",
        "m",
        "--cors-allow-origins",
        "http://a.test, http://b.test:8080",
        "--cors-allow-origins",
        "http://c.test",
    )
    assert result.exit_code == 0, result.output
    assert captured[0].cors_allow_origins == [
        "http://a.test",
        "http://b.test:8080",
        "http://c.test",
    ]


def test_a_registry_alone_is_enough_to_serve(captured: list[Settings], tmp_path: Path) -> None:
    assert _serve("--registry", str(tmp_path / "r.toml")).exit_code == 0
    assert captured[0].registry == str(tmp_path / "r.toml")


def test_an_invalid_flag_value_is_a_clear_error(captured: list[Settings]) -> None:
    result = _serve("--model", "m", "--max-num-seqs", "0")
    assert result.exit_code == 2
    assert "max_num_seqs" in result.output
    assert not captured


def test_every_setting_is_a_flag_or_listed_as_env_only() -> None:
    renamed = {
        "api_key": "api_keys",
        "admin_key": "admin_keys",
        "lazy_load": "load_on_startup",
        "no_ui": "ui",
        "no_engine_process": "engine_process",
        "no_prefix_caching": "enable_prefix_caching",
        "no_warmup": "warmup",
    }
    flags = {renamed.get(p.name, p.name) for p in _serve_params() if p.name not in ("config",)}
    flags.discard("help")
    fields = set(Settings.model_fields)
    assert flags <= fields, f"flags with no setting: {flags - fields}"
    listed = flags | set(serve.ENV_ONLY) | set(serve.INTERNAL)
    assert fields - listed == set(), "add a flag, or list the setting in serve.ENV_ONLY"
    assert not flags & set(serve.ENV_ONLY), "a setting with a flag is listed as env-only"


def test_help_fits_80_columns_with_every_flag_whole_and_its_default() -> None:
    result = _serve("--help", COLUMNS="80", TERMINAL_WIDTH="80")
    assert result.exit_code == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.output)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    tokens = set(re.findall(r"--[a-z0-9-]+", text))
    for param in _serve_params():
        for opt in param.opts:
            if opt.startswith("--"):
                assert opt in tokens, f"{opt} is cut or missing in --help"
    assert re.search(r"--max-model-len\b[^─]*?\(default:\s+32768\)", text)
    assert "VLMSERVE_API_KEYS" in text and "VLMSERVE_ADMIN_KEYS" in text  # prefer env to ps


def test_prefix_caching_is_on_unless_turned_off(captured: list[Settings]) -> None:
    """On by default, as in vLLM; ``--no-enable-prefix-caching`` turns it off."""
    assert _serve("--model", "m").exit_code == 0
    assert _serve("--model", "m", "--no-enable-prefix-caching").exit_code == 0
    assert _serve("--model", "m", "--enable-prefix-caching").exit_code == 0
    assert [s.enable_prefix_caching for s in captured] == [True, False, True]


def test_strict_fields_is_a_flag_of_serve_and_of_demo(captured: list[Settings]) -> None:
    assert _serve("--model", "m", "--strict-fields").exit_code == 0
    demo = CliRunner().invoke(main.app, ["demo", "--strict-fields"])
    assert demo.exit_code == 0, demo.output
    plain = CliRunner().invoke(main.app, ["demo"])
    assert plain.exit_code == 0, plain.output
    assert [s.strict_fields for s in captured] == [True, True, False]


AUTH_AND_CORS = {"api_key", "admin_key", "cors_allow_origins"}


def _params(command: str) -> dict[str, Any]:
    group = typer.main.get_command(main.app)
    return {p.name: p for p in group.commands[command].params}  # type: ignore[attr-defined]


def test_demo_takes_every_auth_and_cors_flag_of_serve_with_the_same_help() -> None:
    serve_params, demo_params = _params("serve"), _params("demo")
    panel = {name for name, p in serve_params.items() if name in AUTH_AND_CORS}
    assert panel == AUTH_AND_CORS  # serve still has them under these names
    for name in AUTH_AND_CORS:
        assert demo_params[name].opts == serve_params[name].opts, name
        assert demo_params[name].help == serve_params[name].help, name
        assert demo_params[name].multiple
    result = CliRunner().invoke(main.app, ["demo", "--help"], env={"COLUMNS": "100"})
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.output)
    assert "--api-key" in text and "--admin-key" in text and "--cors-allow-origins" in text


def test_demo_auth_and_cors_flags_reach_the_settings(captured: list[Settings]) -> None:
    args = ["demo", "--api-key", "k1,k2", "--api-key", "k3", "--admin-key", "a1"]
    result = CliRunner().invoke(
        main.app, [*args, "--cors-allow-origins", "http://a.test, http://b.test"]
    )
    assert result.exit_code == 0, result.output
    s = captured[0]
    assert s.api_keys == ["k1", "k2", "k3"] and s.admin_keys == ["a1"]
    assert s.cors_allow_origins == ["http://a.test", "http://b.test"]
    assert [m.name for m in s.model_configs()] == ["tiny-qwen2-vl", "tiny-vlm2vec"]


def test_demo_without_key_flags_leaves_the_environment_in_force(
    captured: list[Settings],
) -> None:
    env = {"VLMSERVE_API_KEYS": '["from-env"]'}
    result = CliRunner().invoke(main.app, ["demo"], env=env)
    assert result.exit_code == 0, result.output
    assert captured[0].api_keys == ["from-env"] and captured[0].admin_keys == []
