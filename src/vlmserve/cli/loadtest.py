"""`vlmserve loadtest URL`: streaming load with vLLM-style metrics (TTFT, TPOT, ITL, goodput)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from vlmserve.client.http import ServerUnreachable
from vlmserve.client.loadtest import LoadConfig, render_report, run_load
from vlmserve.client.stats import LoadReport

__all__ = ["command", "parse_size"]

_Opt = Optional  # typer reads Optional[...] (py3.10 has no X | None at runtime)


def parse_size(text: str | None) -> tuple[int, int] | None:
    """``"448x448"`` -> ``(448, 448)``."""
    if text is None:
        return None
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) * int(height) == 0:
        raise typer.BadParameter(
            f"expected WIDTHxHEIGHT such as 448x448, got {text!r}", param_hint="--image"
        )
    return int(width), int(height)


def _run(cfg: LoadConfig, err: Console) -> LoadReport:
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, disable=not err.is_terminal) as bar:
        task = bar.add_task("requests", total=cfg.requests)
        return asyncio.run(run_load(cfg, progress=lambda done, _: bar.update(task, completed=done)))


def command(
    url: Annotated[str, typer.Argument(help="Server base URL, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="Model name to request.")],
    concurrency: Annotated[int, typer.Option(help="Most requests in flight at once.")] = 8,
    requests: Annotated[int, typer.Option(help="Requests to send in all.")] = 100,
    rate: Annotated[
        _Opt[float], typer.Option(help="Poisson arrivals, req/s (default: all at once).")
    ] = None,
    image: Annotated[
        _Opt[str], typer.Option(help="Add a WxH random-noise PNG to each request.")
    ] = None,
    video: Annotated[
        _Opt[int], typer.Option(help="Add an MP4 of this many 64x64 noise frames.")
    ] = None,
    distinct_media: Annotated[
        bool, typer.Option(help="New media per request (default: shared).")
    ] = False,
    max_tokens: Annotated[int, typer.Option(help="max_tokens per request.")] = 64,
    prompt_words: Annotated[int, typer.Option(help="Random words per prompt.")] = 32,
    ignore_eos: Annotated[
        bool, typer.Option(help="Generate exactly max_tokens (vLLM extension).")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed for prompts, media and arrivals.")] = 0,
    slo_ttft_ms: Annotated[
        _Opt[float], typer.Option(help="Goodput SLO: TTFT at most this.")
    ] = None,
    slo_tpot_ms: Annotated[
        _Opt[float], typer.Option(help="Goodput SLO: TPOT at most this.")
    ] = None,
    api_key: Annotated[
        _Opt[str], typer.Option(envvar="VLMSERVE_API_KEY", help="Bearer token.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 300.0,
    json_out: Annotated[
        _Opt[Path], typer.Option("--json", help="Write the full report here.")
    ] = None,
) -> None:
    """Load a server with streaming chat requests; print TTFT/TPOT/ITL/E2E and throughput."""
    cfg = LoadConfig(
        base_url=url,
        model=model,
        concurrency=concurrency,
        requests=requests,
        rate=rate,
        image=parse_size(image),
        video_frames=video,
        max_tokens=max_tokens,
        prompt_words=prompt_words,
        ignore_eos=ignore_eos,
        seed=seed,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        api_key=api_key,
        timeout=timeout,
        distinct_media=distinct_media,
    )
    _run_and_report(cfg, json_out)


def _run_and_report(cfg: LoadConfig, json_out: _Opt[Path]) -> None:
    err = Console(stderr=True)
    try:
        report = _run(cfg, err)
    except (ServerUnreachable, ValueError) as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=1) from None
    Console(width=max(Console().width, 100)).print(render_report(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        err.print(f"report written to {json_out}")
    if report.completed == 0:
        first = next(iter(report.error_examples.values()), "")
        err.print(f"[bold red]error:[/] every request failed; first error: {first}")
        raise typer.Exit(code=1)
