"""benchmarks/runner.py: the decode step of the engine's runner over a filled paged cache,
timed at a tiny size, against the floor from the bytes it must read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from support import benchmark_module


@pytest.fixture(scope="module")
def runner() -> Iterator[ModuleType]:
    with benchmark_module("runner.py") as module:
        yield module


def test_tables_give_each_row_its_own_blocks_with_room_for_the_new_token(
    runner: ModuleType,
) -> None:
    tables = runner.tables_for(3, 32, 16)  # 32 tokens + the step's: 3 blocks a row
    assert tables == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert runner.tables_for(1, 31, 16) == [[1, 2]]  # 31 + 1 fills two blocks exactly


def test_a_tiny_run_times_the_step_and_divides_by_the_floor(
    runner: ModuleType, tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runner.json"
    argv = [
        "--model",
        str(tiny_dir),
        "--dtype",
        "float32",
        "--batch",
        "3",
        "--context",
        "40",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--copy-mib",
        "8",
        "--json",
        str(out),
    ]
    result = runner.main(argv)
    saved = json.loads(out.read_text())
    assert saved["ms_per_step"] == result.ms_per_step > 0
    assert (saved["batch"], saved["context"], saved["steps"]) == (3, 40, 3)
    # the tiny model: 2 layers x 2 KV heads x head_dim 32, keys and values, float32
    assert saved["kv_bytes"] == 3 * 41 * (2 * 2 * 2 * 32 * 4)
    assert 0 < saved["weight_bytes"] < 4 * 1_000_000  # language model only, tied head once
    floor = (saved["weight_bytes"] + saved["kv_bytes"]) / (saved["copy_bandwidth_gb_s"] * 1e9)
    assert saved["floor_ms"] == pytest.approx(floor * 1e3)
    assert saved["ratio"] == pytest.approx(saved["ms_per_step"] / saved["floor_ms"])
    text = capsys.readouterr().out
    assert "ms/step" in text and "floor" in text and "x the floor" in text


def test_a_context_past_the_checkpoints_positions_is_refused(
    runner: ModuleType, tiny_dir: Path
) -> None:
    argv = [
        "--model",
        str(tiny_dir),
        "--dtype",
        "float32",
        "--batch",
        "1",
        "--context",
        "4096",
        "--copy-mib",
        "1",
    ]
    with pytest.raises(SystemExit, match="4096 positions"):
        runner.main(argv)


def test_flags_must_be_positive(runner: ModuleType) -> None:
    with pytest.raises(SystemExit):
        runner.parse_args(["--batch", "0"])
