"""Settings precedence: flags > VLMSERVE_* environment > TOML file > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmserve.config import load_settings
from vlmserve.errors import ConfigError


def test_defaults_are_safe() -> None:
    s = load_settings()
    assert s.host == "127.0.0.1" and s.allowed_local_media_path == []
    assert s.media_allow_private_networks is False and s.model_configs() == []


def test_flags_beat_env_which_beats_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "vlmserve.toml"
    config.write_text('port = 7000\nmax_tokens = 11\nmodel = "/models/a"\nmax_video_frames = 3\n')
    monkeypatch.setenv("VLMSERVE_MAX_TOKENS", "22")
    monkeypatch.setenv("VLMSERVE_MAX_VIDEO_FRAMES", "4")
    s = load_settings(config, max_video_frames=5, host=None)
    assert (s.port, s.max_tokens, s.max_video_frames, s.model) == (7000, 22, 5, "/models/a")


def test_models_table_in_the_file(tmp_path: Path) -> None:
    config = tmp_path / "vlmserve.toml"
    config.write_text(
        '[[models]]\nsource = "/m/chat"\nroles = ["chat", "caption"]\n\n'
        '[[models]]\nname = "emb"\nsource = "/m/base"\nadapter = "/m/lora"\nroles = ["embedding"]\n'
    )
    chat, emb = load_settings(config).model_configs()
    assert chat.served_name == "chat" and emb.adapter == "/m/lora"


def test_unknown_keys_and_bad_values_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "vlmserve.toml"
    config.write_text("max_tokenz = 3\n")
    with pytest.raises(ValueError, match="max_tokenz"):
        load_settings(config)
    with pytest.raises(ValueError, match="device"):
        load_settings(device="tpu")
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")
