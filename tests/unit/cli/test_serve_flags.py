"""`vlmserve serve` flags reach the settings the server is built from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from vlmserve.cli import main
from vlmserve.config import Settings


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    seen: list[Settings] = []
    monkeypatch.setattr(main, "_run", seen.append)
    return seen


def _serve(*args: str) -> Any:
    return CliRunner().invoke(main.app, ["serve", *args])


def test_every_serve_flag_reaches_the_settings(captured: list[Settings], tmp_path: Path) -> None:
    registry = tmp_path / "registry.toml"
    result = _serve(
        "--model", "some/model", "--attn-implementation", "sdpa", "--min-pixels", "3136",
        "--max-pixels", "50176", "--max-video-frames", "4", "--trust-remote-code",
        "--log-level", "debug", "--registry", str(registry), "--max-num-seqs", "1",
        "--max-num-batched-tokens", "512", "--vision-cache-bytes", "0", "--stream-interval", "2",
        "--max-queued-requests", "7", "--api-key", "k1", "--api-key", "k2",
        "--processor-cache-bytes", "1024",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    s = captured[0]
    assert (s.attn_implementation, s.min_pixels, s.max_pixels) == ("sdpa", 3136, 50176)
    assert (s.max_video_frames, s.trust_remote_code, s.log_level) == (4, True, "debug")
    assert s.registry == str(registry)
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.vision_cache_bytes) == (1, 512, 0)
    assert s.max_queued_requests == 7 and s.stream_interval == 2
    assert s.processor_cache_bytes == 1024
    assert s.api_keys == ["k1", "k2"]


def test_unset_flags_keep_the_defaults(captured: list[Settings]) -> None:
    assert _serve("--model", "some/model").exit_code == 0
    defaults = Settings()
    assert captured[0].max_num_seqs == defaults.max_num_seqs
    assert captured[0].api_keys == []


def test_a_registry_alone_is_enough_to_serve(captured: list[Settings], tmp_path: Path) -> None:
    assert _serve("--registry", str(tmp_path / "r.toml")).exit_code == 0
    assert captured[0].registry == str(tmp_path / "r.toml")


def test_an_invalid_flag_value_is_a_clear_error(captured: list[Settings]) -> None:
    result = _serve("--model", "m", "--max-num-seqs", "0")
    assert result.exit_code == 2
    assert "max_num_seqs" in result.output
    assert not captured
