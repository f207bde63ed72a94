"""benchmarks/prefill.py: a prompt's prefill through the engine's runner, whole or after a
cached prefix, timed at a tiny size against the same rows through the linears alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from support import benchmark_module


@pytest.fixture(scope="module")
def prefill() -> Iterator[ModuleType]:
    with benchmark_module("prefill.py") as module:
        yield module


def _argv(tiny_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny_dir), "--dtype", "float32", "--repeat", "2", *extra]


@pytest.mark.parametrize("prefix", [0, 24])
def test_a_tiny_run_times_the_prefill_against_its_linears(
    prefill: ModuleType,
    tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    prefix: int,
) -> None:
    out = tmp_path / "prefill.json"
    argv = _argv(tiny_dir, "--batch", "2", "--context", "40", "--prefix", str(prefix))
    result = prefill.main([*argv, "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["ms"] == result.ms > 0 and saved["linears_ms"] > 0
    assert (saved["batch"], saved["context"], saved["prefix"]) == (2, 40, prefix)
    assert saved["tokens_per_s"] == pytest.approx(2 * 40 / saved["ms"] * 1e3)
    assert saved["ratio"] == pytest.approx(saved["ms"] / saved["linears_ms"])
    # float32: torch's attention, whatever the CPU
    assert saved["attention"] == "torch scaled_dot_product_attention"
    text = capsys.readouterr().out
    assert "tokens/s" in text and "its matmul cost" in text
    assert ("cached" in text) == bool(prefix)


def test_the_rows_write_their_new_tokens_after_the_prefix(
    prefill: ModuleType, tiny_dir: Path
) -> None:
    ns = prefill.parse_args(_argv(tiny_dir, "--batch", "2", "--context", "5", "--prefix", "20"))
    tables = [[1, 2], [3, 4]]

    class Runner:  # what rows_for reads of the runner
        hidden, device, dtype = 8, "cpu", torch.float32

    rows = prefill.rows_for(Runner(), ns, tables)
    # tokens 20..24 of a row: block 2 of its table (16-token blocks), offsets 4..8
    assert rows[0].slots == [2 * 16 + i for i in range(4, 9)]
    assert rows[1].slots == [4 * 16 + i for i in range(4, 9)]
    assert all(r.cached == 20 and r.positions[:, 0].tolist() == [20, 20, 20] for r in rows)
    assert rows[0].table == [1, 2] and rows[0].embeds.shape == (5, 8)


def test_a_prompt_past_the_checkpoints_positions_is_refused(
    prefill: ModuleType, tiny_dir: Path
) -> None:
    with pytest.raises(SystemExit, match="4096 positions"):
        prefill.main(_argv(tiny_dir, "--context", "4000", "--prefix", "100"))


def test_flags_are_checked(prefill: ModuleType) -> None:
    for bad in (["--context", "0"], ["--prefix", "-1"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            prefill.parse_args(bad)
