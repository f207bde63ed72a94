"""``vlmserve registry``: list, show, lock, verify and snapshot through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from vlmserve.cli.registry import registry_app
from vlmserve.registry.files import read_entries

WEIGHTS = "model.safetensors"


@pytest.fixture
def setup(tmp_path: Path, tiny_dir: Path) -> tuple[Path, Path]:
    """A curated file around a copy of the tiny checkpoint, and a discovered file."""
    model = Path(shutil.copytree(tiny_dir, tmp_path / "tiny"))
    curated = tmp_path / "registry.toml"
    curated.write_text(
        "# my models\n"
        '[[models]]\nname = "hub-model"\nsource = "Qwen/Qwen2-VL-2B-Instruct"\n'
        'roles = ["caption"]\n\n'
        "# the local one\n"
        f'[[models]]\nname = "tiny"\nsource = "{model}"\nserved_model_id = "tiny-served"\n'
        'model_aliases = ["tiny-alias"]\n\n'
        "[models.capabilities]\nvideo = true\n\n"
        '[[models]]\nname = "old"\nsource = "/nowhere"\ndeprecated = true\n'
    )
    discovered = tmp_path / "discovered.json"
    discovered.write_text(json.dumps({"models": [{"name": "found", "source": str(model)}]}))
    return curated, discovered


def run(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    base = {"COLUMNS": "250", "VLMSERVE_REGISTRY": "", "VLMSERVE_REGISTRY_DISCOVERED": ""}
    return CliRunner().invoke(registry_app, [str(a) for a in args], env={**base, **(env or {})})


def test_list_shows_every_merged_entry(setup: tuple[Path, Path]) -> None:
    curated, discovered = setup
    result = run("list", "-r", curated, "--discovered", discovered)
    assert result.exit_code == 0, result.output
    lines = {line.split()[1]: line for line in result.stdout.splitlines() if "│" in line}
    assert list(lines) == ["hub-model", "tiny", "old", "found"]
    assert "tiny-served" in lines["tiny"] and "tiny-alias" in lines["tiny"]
    assert "vision, video" in lines["tiny"] and "curated" in lines["tiny"]
    assert "yes" in lines["old"] and "discovered" in lines["found"]


def test_registry_path_comes_from_the_environment(setup: tuple[Path, Path]) -> None:
    result = run("show", "tiny-alias", env={"VLMSERVE_REGISTRY": str(setup[0])})
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert (shown["name"], shown["served_model_id"], shown["version_lock"]) == (
        "tiny",
        "tiny-served",
        None,
    )


def test_show_unknown_model_exits_2_listing_the_available_ones(setup: tuple[Path, Path]) -> None:
    result = run("show", "nope", "-r", setup[0])
    assert result.exit_code == 2
    assert "'nope' is not in the registry" in result.stderr
    assert "hub-model, tiny" in result.stderr


def test_invalid_registry_file_exits_2_naming_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "registry.toml"
    bad.write_text('[[models]]\nname = "x"\nbackend = "hf"\n')
    result = run("list", "-r", bad)
    assert result.exit_code == 2
    assert "models[0] (x)" in result.stderr and "needs `source`" in result.stderr
    assert run("list", "-r", tmp_path / "missing.toml").exit_code == 2


def test_lock_then_verify_passes_and_other_entries_are_kept(setup: tuple[Path, Path]) -> None:
    curated, _ = setup
    before = curated.read_text()
    result = run("lock", "-r", curated)
    assert result.exit_code == 0, result.output
    assert "tiny" in result.stdout and "locked" in result.stdout
    assert "skipped" in result.stderr and "hub-model" in result.stderr  # hub id: not lockable
    after = curated.read_text()
    assert after.startswith(before.split('[[models]]\nname = "old"')[0].rstrip() + "\n")
    assert "# my models" in after and "# the local one" in after
    entries = read_entries(curated)
    assert [e.name for e in entries] == ["hub-model", "tiny", "old"]
    assert [e.version_lock is not None for e in entries] == [False, True, False]
    assert entries[1].capabilities.video and entries[2].deprecated

    verified = run("verify", "-r", curated)
    assert verified.exit_code == 0, verified.output
    rows = {line.split()[1]: line for line in verified.stdout.splitlines() if "│" in line}
    assert "ok" in rows["tiny"] and "not locked" in rows["hub-model"]

    relock = run("lock", "tiny", "-r", curated)
    assert relock.exit_code == 0 and "unchanged" in relock.stdout
    assert curated.read_text() == after  # nothing changed, nothing rewritten (locked_at kept)


def test_verify_exits_1_naming_the_one_flipped_weight_file(setup: tuple[Path, Path]) -> None:
    curated, _ = setup
    assert run("lock", "tiny", "-r", curated).exit_code == 0
    model = Path(read_entries(curated)[1].source or "")
    data = bytearray((model / WEIGHTS).read_bytes())
    data[-100] ^= 0xFF
    (model / WEIGHTS).write_bytes(bytes(data))
    (model / "extra.txt").write_text("new")

    result = run("verify", "tiny-served", "-r", curated)
    assert result.exit_code == 1
    assert "DRIFT" in result.stdout
    assert f"tiny: changed: {WEIGHTS}" in result.stdout
    assert "tiny: added: extra.txt" in result.stdout
    assert "config.json" not in result.stdout
    assert "2 problem(s)" in result.stderr

    relock = run("lock", "tiny", "-r", curated)
    assert "re-locked (2 files changed)" in relock.stdout
    assert run("verify", "tiny", "-r", curated).exit_code == 0


def test_lock_by_name_refuses_what_it_cannot_lock(setup: tuple[Path, Path]) -> None:
    curated, discovered = setup
    before = curated.read_text()
    hub = run("lock", "hub-model", "-r", curated)
    assert hub.exit_code == 2 and "download it and point source" in hub.stderr
    found = run("lock", "found", "-r", curated, "--discovered", discovered)
    assert found.exit_code == 2 and "copy it into the curated file" in found.stderr
    assert curated.read_text() == before


def test_snapshot_writes_the_same_bytes_every_time(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    curated, discovered = setup
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outs:
        result = run("snapshot", "--out", out, "-r", curated, "--discovered", discovered)
        assert result.exit_code == 0 and "wrote 4 entries" in result.stderr
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert [e.name for e in read_entries(outs[0])] == ["found", "hub-model", "old", "tiny"]
