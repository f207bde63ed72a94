"""``--chat-template``: the operator's template replaces the checkpoint's, checked at load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vlmserve.config import ModelConfig, Settings
from vlmserve.engine.types import ChatMessage, TextPart
from vlmserve.errors import ConfigError
from vlmserve.registry.build import hf_backend

CUSTOM = (
    "{% for m in messages %}<<{{ m['role'] }}>>"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


def backend(tiny_dir: Path, template: str | None) -> object:
    settings = Settings(device="cpu", chat_template=template, engine_process=False)
    return hf_backend(ModelConfig(name="tiny", source=str(tiny_dir)), settings)


def test_a_template_file_replaces_the_checkpoints(tiny_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "custom.jinja"
    path.write_text(CUSTOM)
    model = backend(tiny_dir, str(path))
    model.load()  # type: ignore[attr-defined]
    try:
        prompt = model.render_prompt([ChatMessage("user", [TextPart("Hello")])])  # type: ignore[attr-defined]
    finally:
        model.close()  # type: ignore[attr-defined]
    assert prompt == "<<user>>Hello<<assistant>>"


def test_template_text_works_as_well_as_a_file(tiny_dir: Path) -> None:
    model = backend(tiny_dir, CUSTOM)
    model.load()  # type: ignore[attr-defined]
    try:
        prompt = model.render_prompt([ChatMessage("user", [TextPart("Hi")])])  # type: ignore[attr-defined]
    finally:
        model.close()  # type: ignore[attr-defined]
    assert prompt.startswith("<<user>>Hi")


def test_a_missing_file_fails_before_loading(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        backend(tiny_dir, str(tmp_path / "nope.jinja"))


def test_a_broken_template_fails_the_load_naming_the_model(tiny_dir: Path) -> None:
    model = backend(tiny_dir, "{% for m in messages %}{{ m['role'] }")
    with pytest.raises(ConfigError, match="does not render"):
        model.load()  # type: ignore[attr-defined]


def test_the_cli_says_what_is_wrong_without_a_traceback(tiny_dir: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlmserve.cli.main",
            "serve",
            "--model",
            str(tiny_dir),
            "--chat-template",
            str(tmp_path / "missing.jinja"),
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "neither a file nor a Jinja template" in done.stderr
    assert "Traceback" not in done.stderr
