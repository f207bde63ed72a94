"""`vlmserve preflight URL`: is this OpenAI-compatible server ready? (the tagger's checks)"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from vlmserve.client.preflight import PreflightReport, run_preflight

__all__ = ["command", "render"]

_STYLE = {"ok": "green", "FAIL": "bold red", "skip": "yellow"}


def render(report: PreflightReport) -> Table:
    table = Table(
        title=f"preflight {report.url} (model: {report.model or '?'})", title_justify="left"
    )
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("latency ms", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for c in report.checks:
        status = f"[{_STYLE[c.status]}]{c.status}[/]"
        latency = f"{c.latency_ms:.1f}" if c.ok is not None else "-"
        table.add_row(c.name, status, latency, c.detail)
    return table


def command(
    url: Annotated[str, typer.Argument(help="Server base URL, e.g. http://127.0.0.1:8000")],
    model: Annotated[
        Optional[str],  # noqa: UP045 - typer needs Optional on py3.10
        typer.Option(help="Model to check (default: the first one /v1/models lists)."),
    ] = None,
    api_key: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(envvar="VLMSERVE_API_KEY", help="Bearer token, if the server wants one."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 30.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report instead.")] = False,
) -> None:
    """Check a server: /v1/models, a text chat, a vision chat (1x1 PNG), embeddings if offered.

    Exits 1 when any check fails, naming it.
    """
    if timeout <= 0:
        raise typer.BadParameter(f"must be > 0, got {timeout}", param_hint="--timeout")
    report = asyncio.run(run_preflight(url, model, api_key=api_key, timeout=timeout))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        console = Console(width=max(Console().width, 100))
        console.print(render(report))
        if report.ok:
            console.print("[green]preflight passed[/]")
        else:
            console.print(f"[bold red]preflight FAILED:[/] {', '.join(report.failed)}")
    if not report.ok:
        raise typer.Exit(code=1)
