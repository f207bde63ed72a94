"""``vlmserve registry discover``: a folder of checkpoints -> the discovered layer."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from vlmserve.cli.registry import registry_app
from vlmserve.registry.discover import discover
from vlmserve.registry.files import load_registry
from vlmserve.testing.families import build_family

ENV = {"COLUMNS": "250", "VLMSERVE_REGISTRY": "", "VLMSERVE_REGISTRY_DISCOVERED": ""}


def models_root(tmp_path: Path, tiny_dir: Path) -> Path:
    root = tmp_path / "models"
    (root / "Qwen").mkdir(parents=True)
    (root / "Qwen" / "Qwen2-VL-2B").symlink_to(tiny_dir)  # org/name layout
    (root / "llava-1.5-7b").symlink_to(build_family("llava"))
    (root / "qwen3-vl-thinking").symlink_to(build_family("qwen3_vl"))
    (root / "notes").mkdir()
    (root / "notes" / "config.json").write_text(json.dumps({"not": "a model"}))
    return root


def test_each_checkpoint_becomes_an_entry_with_what_it_takes(
    tmp_path: Path, tiny_dir: Path
) -> None:
    entries = {e.name: e for e in discover(models_root(tmp_path, tiny_dir))}
    assert sorted(entries) == ["Qwen-Qwen2-VL-2B", "llava-1.5-7b", "qwen3-vl-thinking"]
    llava, qwen3 = entries["llava-1.5-7b"], entries["qwen3-vl-thinking"]
    assert llava.architecture == "LlavaForConditionalGeneration"
    assert llava.capabilities.enabled() == ["vision"]  # no video processor, no video template
    assert qwen3.capabilities.enabled() == ["vision", "video"]
    assert entries["Qwen-Qwen2-VL-2B"].source == str(tiny_dir.resolve())
    assert all((e.size_bytes or 0) > 100_000 for e in entries.values())
    assert all(e.quantization is None for e in entries.values())


def test_write_then_list_shows_them_and_the_curated_file_wins(
    tmp_path: Path, tiny_dir: Path
) -> None:
    root, out = models_root(tmp_path, tiny_dir), tmp_path / "registry.discovered.toml"
    runner = CliRunner()
    done = runner.invoke(
        registry_app, ["discover", str(root), "--write", "--discovered", str(out)], env=ENV
    )
    assert done.exit_code == 0, done.output
    curated = tmp_path / "registry.toml"
    curated.write_text(
        '[[models]]\nname = "llava-1.5-7b"\nsource = "/srv/llava"\nroles = ["chat", "caption"]\n'
    )
    merged = load_registry(curated, out)
    assert merged.get("llava-1.5-7b").source == "/srv/llava"  # type: ignore[union-attr]
    assert merged.origin("qwen3-vl-thinking") == "discovered"
    listed = runner.invoke(
        registry_app, ["list", "-r", str(curated), "--discovered", str(out)], env=ENV
    )
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if "qwen3-vl-thinking" in line)
    assert "vision, video" in row and "discovered" in row


def test_dry_run_writes_nothing_and_a_missing_root_is_an_error(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(registry_app, ["discover", str(tmp_path / "nope")], env=ENV)
    assert missing.exit_code == 2 and "is not a directory" in missing.output
    empty = runner.invoke(registry_app, ["discover", str(tmp_path)], env=ENV)
    assert empty.exit_code == 0
    assert not list(tmp_path.glob("*.toml"))
