"""benchmarks/vllm_random.py plumbing: the command line handed to ``vllm bench serve`` for its
random dataset, the seeds that keep every prompt cold yet equal across servers, the medians over
rounds and the ratio rows marked against the ITL targets. No server and no vLLM is started here
(the benchmark is run by hand; its figures are in docs/performance.md)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from rich.console import Console

from support import benchmark_module


@pytest.fixture(scope="module")
def vr() -> Iterator[ModuleType]:
    with benchmark_module("vllm_random.py") as module:
        yield module


def _config(vr: ModuleType, tmp_path: Path, *extra: str) -> Any:
    argv = ["--model", str(tmp_path / "ckpt"), "--peers-dir", str(tmp_path / "peers"), *extra]
    return vr.build_config(vr.parse_args(argv))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_prompt_is_exactly_the_input_length_from_vllms_random_dataset(
    vr: ModuleType, tmp_path: Path
) -> None:
    from peers.vllm_client import bench_argv

    cfg = _config(vr, tmp_path, "--input-len", "1500", "--max-tokens", "32")
    run = vr.bench_run(cfg, "http://127.0.0.1:9", "x", 4, 8, vr.level_seed(cfg, 4, 0))
    argv = bench_argv("python", run)
    assert _flag(argv, "--dataset-name") == "random"
    assert _flag(argv, "--random-input-len") == "1500"
    assert _flag(argv, "--random-output-len") == "32"
    assert _flag(argv, "--random-range-ratio") == "0"  # no spread: every prompt 1,500 tokens
    assert _flag(argv, "--seed") == str(run.seed)
    assert (_flag(argv, "--max-concurrency"), _flag(argv, "--num-prompts")) == ("4", "8")
    assert "--ignore-eos" in argv and _flag(argv, "--tokenizer") == str(tmp_path / "ckpt")
    # the random text is sent as it is; the custom dataset's flags are not
    assert "--skip-chat-template" not in argv and "--dataset-path" not in argv


def test_the_custom_dataset_keeps_its_command_line(vr: ModuleType, tmp_path: Path) -> None:
    from peers.vllm_client import BenchRun, bench_argv

    run = BenchRun("http://h", "tiny", "tok", 8, 2, tmp_path / "p.jsonl", tmp_path / "r.json", 4)
    argv = bench_argv("python", run)
    assert _flag(argv, "--dataset-name") == "custom"
    assert _flag(argv, "--dataset-path") == str(tmp_path / "p.jsonl")
    assert "--skip-chat-template" in argv and "--random-input-len" not in argv


def test_seeds_are_new_for_each_level_and_round_and_apart_from_the_warmup(
    vr: ModuleType, tmp_path: Path
) -> None:
    cfg = _config(vr, tmp_path, "--concurrency", "1", "4", "8", "--rounds", "3")
    levels = [vr.level_seed(cfg, c, r) for r in range(3) for c in cfg.concurrencies]
    warmups = [vr.warmup_seed(cfg, r) for r in range(3)]
    assert len(set(levels + warmups)) == len(levels) + len(warmups)
    assert all(seed >= 0 for seed in levels + warmups)  # numpy refuses negative seeds
    other = _config(vr, tmp_path, "--seed", "1")
    assert vr.level_seed(other, 4, 0) != vr.level_seed(cfg, 4, 0)


def test_the_server_order_rotates_with_the_round(vr: ModuleType) -> None:
    assert vr.server_order(0) == ["vlmserve", "vllm"]
    assert vr.server_order(1) == ["vllm", "vlmserve"]


def test_arguments_are_checked(vr: ModuleType, tmp_path: Path) -> None:
    for bad in (["--concurrency", "0"], ["--input-len", "0"], ["--requests", "-1"]):
        with pytest.raises(SystemExit):
            _config(vr, tmp_path, *bad)
    cfg = _config(vr, tmp_path)
    assert (cfg.input_len, cfg.concurrencies, cfg.dtype) == (2000, [4, 8], "float32")
    assert vr.requests_for(cfg, 8) == 16 and vr.requests_for(cfg, 1) == 8


def _figures(itl50: float, itl99: float, tps: float = 100.0) -> dict[str, float]:
    return {
        "ttft_p50_ms": 900.0,
        "tpot_p50_ms": itl50 * 1.1,
        "itl_p50_ms": itl50,
        "itl_p99_ms": itl99,
        "output_tps": tps,
        "input_tokens": 2001.0,
        "failed": 0,
    }


def test_medians_over_rounds_and_ratios_marked_against_the_targets(vr: ModuleType) -> None:
    samples = [
        vr.Sample("vlmserve", 4, 0, _figures(10, 50)),
        vr.Sample("vlmserve", 4, 1, _figures(12, 90)),
        vr.Sample("vlmserve", 4, 2, _figures(30, 70)),
        vr.Sample("vllm", 4, 0, _figures(10, 40)),
        vr.Sample("vllm", 8, 0, _figures(10, 40)),  # no vlmserve figure at c=8: no row
        vr.Sample("vlmserve", 1, 0, _figures(13, 81)),
        vr.Sample("vllm", 1, 0, _figures(10, 40)),
    ]
    summary = vr.summarize(samples)
    assert summary[("vlmserve", 4)]["itl_p50_ms"] == 12  # the median, not the mean
    assert summary[("vlmserve", 4)]["itl_p99_ms"] == 70 and summary[("vlmserve", 4)]["rounds"] == 3
    rows = vr.ratio_rows(summary)
    assert [r["concurrency"] for r in rows] == [1, 4]
    one, four = rows
    assert four["ratios"]["itl_p50_ms"] == pytest.approx(1.2)
    assert four["meets"] == {"itl_p50_ms": True, "itl_p99_ms": True}  # 1.2x and 1.75x
    assert one["meets"] == {"itl_p50_ms": False, "itl_p99_ms": False}  # 1.3x and 2.025x
    out = io.StringIO()
    cfg = _config(vr, Path("/tmp"))
    Console(file=out, width=300).print(vr.ratio_table(rows, cfg))
    assert "over" in out.getvalue() and "ok" in out.getvalue()


def test_without_vllm_installed_it_says_how_to_install_it(
    vr: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tmp_path), "--peers-dir", str(tmp_path / "none")]
    assert vr.main(argv) == 1
    assert "install_vllm.sh" in capsys.readouterr().out
