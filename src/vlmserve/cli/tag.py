"""``vlmserve tag DIR --server URL``: caption, keywords and a description for every image/video.

Models are picked per task by role (``role:caption`` when the server has a model with that
role), else ``--model``, else the server's first chat model. Runs resume: files whose output
already holds the same sha256 are skipped unless ``--force``. Exit 1 if any file failed.
"""

from __future__ import annotations

import asyncio
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from vlmserve.tagger import RequestFailed, Summary, TagClient, TagOptions, find_media
from vlmserve.tagger.runner import resolve_models, run_tagging

__all__ = ["command"]

console = Console(stderr=True)


class Out(str, Enum):
    sidecar = "sidecar"
    jsonl = "jsonl"
    xmp = "xmp"


async def _preflight(options: TagOptions, model: str) -> None:
    """The server answers text and vision chat before hundreds of files are sent to it."""
    try:
        from vlmserve.client.preflight import run_preflight
    except ImportError:
        console.print("[yellow]preflight is not available in this install; skipping it[/]")
        return
    report = await run_preflight(options.server, model, api_key=options.api_key)
    if report.ok:
        console.print(f"preflight: ok ({', '.join(c.name for c in report.checks if c.ok)})")
    else:
        for check in report.checks:
            mark = {True: "[green]ok[/]", False: "[red]FAIL[/]"}.get(check.ok, "[yellow]skip[/]")
            console.print(f"  {mark} {check.name}: {check.detail}")
        console.print("[bold red]error:[/] preflight failed (--skip-preflight to tag anyway)")
        raise typer.Exit(2)


def _summary_table(summary: Summary) -> Table:
    table = Table(title="vlmserve tag")
    table.add_column("result")
    table.add_column("files", justify="right")
    for status in ("done", "skipped", "failed"):
        table.add_row(status, str(summary.count(status)))
    return table


def _failures_table(summary: Summary) -> Table:
    table = Table(title="failed files")
    table.add_column("file")
    table.add_column("reason")
    for outcome in summary.failed:
        table.add_row(outcome.file, outcome.reason or "")
    return table


async def _run(options: TagOptions, skip_preflight: bool) -> Summary:
    files = find_media(options.root)
    client = TagClient(
        options.server,
        api_key=options.api_key,
        concurrency=options.concurrency,
        timeout=options.timeout,
    )
    async with client:
        models = await resolve_models(client, options)
        console.print("models: " + ", ".join(f"{t} → {m}" for t, m in models.items()))
        if not skip_preflight:
            await _preflight(options, models["caption"])
        columns = (TextColumn("tagging"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            bar = progress.add_task("tag", total=len(files))
            return await run_tagging(
                options, client, models, lambda _: progress.advance(bar), files=files
            )


def command(
    directory: Annotated[Path, typer.Argument(help="Folder of images and videos (recursive).")],
    server: Annotated[str, typer.Option(help="Server base URL, e.g. http://127.0.0.1:8000.")],
    model: Annotated[
        Optional[str],  # noqa: UP045 - typer needs Optional on py3.10
        typer.Option(help="Model for tasks whose role the server lacks (default: its first)."),
    ] = None,
    caption_role: Annotated[str, typer.Option(help="Role of the caption model.")] = "caption",
    keyword_role: Annotated[str, typer.Option(help="Role of the keyword model.")] = "keywords",
    description_role: Annotated[
        str, typer.Option(help="Role of the description model.")
    ] = "description",
    out: Annotated[
        Out, typer.Option(help="sidecar (<file>.json), jsonl (tags.jsonl) or xmp.")
    ] = Out.sidecar,
    concurrency: Annotated[int, typer.Option(min=1, max=64, help="Requests in flight.")] = 4,
    force: Annotated[
        bool, typer.Option(help="Tag again even where the output is current.")
    ] = False,
    skip_preflight: Annotated[bool, typer.Option(help="Do not check the server first.")] = False,
    api_key: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(envvar="VLMSERVE_API_KEY", help="Bearer key for the server."),
    ] = None,
    max_keywords: Annotated[int, typer.Option(min=1, max=100, help="Keywords per file.")] = 10,
    max_tokens: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(min=1, help="Token budget of every call (default: per task)."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds one request may take.")] = 300.0,
) -> None:
    """Caption, keyword and describe every image and video in DIR through a model server."""
    if not directory.is_dir():
        console.print(f"[bold red]error:[/] {directory} is not a folder")
        raise typer.Exit(2)
    options = TagOptions(
        root=directory,
        server=server,
        model=model,
        roles={"caption": caption_role, "keywords": keyword_role, "description": description_role},
        out=out.value,
        concurrency=concurrency,
        force=force,
        api_key=api_key,
        max_keywords=max_keywords,
        max_tokens=max_tokens,
        timeout=timeout,
    )
    try:
        summary = asyncio.run(_run(options, skip_preflight))
    except RequestFailed as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from None
    console.print(_summary_table(summary))
    if summary.failed:
        console.print(_failures_table(summary))
        raise typer.Exit(1)
