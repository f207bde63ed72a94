"""``vlmserve registry``: list, show, verify, lock and snapshot the model registry.

Exit codes: 0 fine, 1 ``verify`` found drift (or could not check a locked entry),
2 a usage or registry-file error (the message says what to fix).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from vlmserve.errors import ConfigError, NotFound
from vlmserve.registry.discover import discover as discover_entries
from vlmserve.registry.discover import discovered_document
from vlmserve.registry.entries import ModelEntry, VersionLock
from vlmserve.registry.files import (
    Registry,
    load_registry,
    write_document,
    write_locks,
    write_snapshot,
)
from vlmserve.registry.lock import OnBytes, hash_artifacts, local_source, total_bytes, verify

__all__ = ["registry_app"]

registry_app = typer.Typer(
    help=(
        "Inspect and pin the model registry: a curated file (yours) layered over a "
        "discovered one (tools'), curated entries winning by name."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RegistryOpt = Annotated[
    Path,
    typer.Option(
        "--registry",
        "-r",
        envvar="VLMSERVE_REGISTRY",
        help="Curated registry file (.toml or .json); `lock` writes into it.",
    ),
]
DiscoveredOpt = Annotated[
    Optional[Path],  # noqa: UP045 - typer needs Optional on py3.10
    typer.Option(
        "--discovered",
        envvar="VLMSERVE_REGISTRY_DISCOVERED",
        help="Discovered registry file, layered under the curated one (may not exist yet).",
    ),
]
NamesArg = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Argument(help="Entries by name, alias or served id [default: all]."),
]


def _fail(message: object, code: int = 2) -> NoReturn:
    Console(stderr=True).print(f"[bold red]error:[/] {escape(str(message))}")
    raise typer.Exit(code=code)


@contextmanager
def _usage_errors() -> Iterator[None]:
    try:
        yield
    except (ConfigError, NotFound, OSError) as exc:
        _fail(exc)


def _select(registry: Registry, names: list[str] | None) -> list[ModelEntry]:
    if not names:
        return list(registry)
    chosen = [registry.resolve(name) for name in names]
    return list({entry.name: entry for entry in chosen}.values())


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def _tracker(progress: Progress, name: str, path: Path) -> OnBytes:
    task = progress.add_task(f"hashing {escape(name)}", total=total_bytes(path))
    return lambda n: progress.advance(task, n)


def _short(entry: ModelEntry) -> str:
    return entry.version_lock.aggregate_sha256[:12] if entry.version_lock else ""


@registry_app.command("list")
def list_(registry: RegistryOpt = Path("registry.toml"), discovered: DiscoveredOpt = None) -> None:
    """A table of every entry of the merged registry."""
    with _usage_errors():
        merged = load_registry(registry, discovered)
    table = Table(title=f"registry {registry}" + (f" + {discovered}" if discovered else ""))
    for column in ("name", "backend", "served id", "roles", "capabilities", "aliases"):
        table.add_column(column, no_wrap=column == "name")
    for column in ("deprecated", "locked", "from"):
        table.add_column(column)
    for e in merged:
        cells = [
            e.name,
            e.backend,
            e.served_id,
            ", ".join(e.roles),
            ", ".join(e.capabilities.enabled()),
            ", ".join(e.model_aliases),
            "yes" if e.deprecated else "",
            "yes" if e.version_lock else "no",
            merged.origin(e.name),
        ]
        table.add_row(*map(escape, cells))
    Console().print(table)


@registry_app.command()
def show(
    name: Annotated[str, typer.Argument(help="Name, alias, served id or role:<role>.")],
    registry: RegistryOpt = Path("registry.toml"),
    discovered: DiscoveredOpt = None,
) -> None:
    """One entry as JSON (after merging and defaults)."""
    with _usage_errors():
        entry = load_registry(registry, discovered).resolve(name)
    typer.echo(json.dumps(entry.model_dump(mode="json"), indent=2, ensure_ascii=False))


@registry_app.command("verify")
def verify_(
    names: NamesArg = None,
    registry: RegistryOpt = Path("registry.toml"),
    discovered: DiscoveredOpt = None,
) -> None:
    """Recompute the artifact hashes of locked entries; exit 1 naming every drifted file."""
    with _usage_errors():
        entries = _select(load_registry(registry, discovered), names)
    table = Table("name", "status", "aggregate", "detail", title="registry verify")
    problems: list[str] = []
    with _progress() as progress:
        for entry in entries:
            if entry.version_lock is None:
                table.add_row(escape(entry.name), "not locked", "", "run `registry lock` to pin")
                continue
            try:
                drifts = verify(entry, _tracker(progress, entry.name, local_source(entry)))
            except (ConfigError, OSError) as exc:
                table.add_row(escape(entry.name), "[red]ERROR[/]", _short(entry), escape(str(exc)))
                problems.append(f"{entry.name}: {exc}")
                continue
            count = len(entry.version_lock.files)
            if drifts:
                detail = f"{len(drifts)} of {count} files differ"
                table.add_row(escape(entry.name), "[red]DRIFT[/]", _short(entry), detail)
                problems.extend(f"{entry.name}: {drift}" for drift in drifts)
            else:
                table.add_row(escape(entry.name), "[green]ok[/]", _short(entry), f"{count} files")
    out = Console()
    out.print(table)
    for line in problems:
        out.print(escape(line), highlight=False, soft_wrap=True)
    if problems:
        _fail(f"{len(problems)} problem(s) found; see above", code=1)


@registry_app.command()
def lock(
    names: NamesArg = None,
    registry: RegistryOpt = Path("registry.toml"),
    discovered: DiscoveredOpt = None,
) -> None:
    """Hash the artifacts of curated entries and write `version_lock` into the curated file.

    Without names: every curated entry whose source is a local directory (others are
    skipped). An entry whose files did not change keeps its lock (and `locked_at`).
    """
    with _usage_errors():
        merged = load_registry(registry, discovered)
        entries = _select(merged, names)
        targets, skipped = _lockable(merged, entries, explicit=bool(names))
    err = Console(stderr=True)
    for line in skipped:
        err.print(f"skipped {escape(line)}", highlight=False)
    table = Table("name", "status", "files", "aggregate", title=f"registry lock -> {registry}")
    new: dict[str, VersionLock] = {}
    with _progress() as progress, _usage_errors():
        for entry, path in targets:
            fresh = hash_artifacts(path, _tracker(progress, entry.name, path))
            old = entry.version_lock
            if old is not None and old.files == fresh.files:
                status = "unchanged"
            else:
                new[entry.name] = fresh
                status = "locked" if old is None else f"re-locked ({_differ(old, fresh)})"
            agg = fresh.aggregate_sha256[:12]
            table.add_row(escape(entry.name), status, str(len(fresh.files)), agg)
    if new:
        with _usage_errors():
            preserved = write_locks(registry, new)
        if not preserved:
            err.print(f"note: {registry} was rewritten whole; its comments were not kept")
    if targets:
        Console().print(table)
    else:
        err.print("nothing to lock: no curated entry has a local source directory")


def _differ(old: VersionLock, new: VersionLock) -> str:
    paths = old.files.keys() | new.files.keys()
    changed = sum(old.files.get(path) != new.files.get(path) for path in paths)
    return f"{changed} file{'s' if changed != 1 else ''} changed"


def _lockable(
    merged: Registry, entries: list[ModelEntry], *, explicit: bool
) -> tuple[list[tuple[ModelEntry, Path]], list[str]]:
    """(entry, weights dir) pairs to hash, and why others were skipped (explicit: an error)."""
    targets: list[tuple[ModelEntry, Path]] = []
    skipped: list[str] = []
    for entry in entries:
        if merged.origin(entry.name) != "curated":
            reason = f"{entry.name}: discovered entry; copy it into the curated file to lock it"
            if explicit:
                raise ConfigError(reason)
            continue  # without names, `lock` only ever touches curated entries
        try:
            targets.append((entry, local_source(entry)))
        except ConfigError as exc:
            if explicit:
                raise
            skipped.append(str(exc))
    return targets, skipped


@registry_app.command()
def discover(
    root: Annotated[Path, typer.Argument(help="Folder holding model directories.")],
    write: Annotated[bool, typer.Option("--write", help="Write the discovered file.")] = False,
    discovered: DiscoveredOpt = None,
) -> None:
    """Scan ROOT for checkpoints; list them, and with --write save the discovered layer
    (--discovered, default registry.discovered.toml). The curated file still wins by name."""
    if not root.is_dir():
        _fail(f"{root} is not a directory")
    entries = discover_entries(root)
    table = Table(title=f"discovered under {root}")
    for column in ("name", "architecture", "capabilities", "quantization", "size", "source"):
        table.add_column(column, no_wrap=column == "name")
    for e in entries:
        size = f"{(e.size_bytes or 0) / 2**20:,.1f} MiB"
        table.add_row(
            *map(
                escape,
                [
                    e.name,
                    e.architecture or "",
                    ", ".join(e.capabilities.enabled()),
                    e.quantization or "",
                    size,
                    e.source or "",
                ],
            )
        )
    Console().print(table)
    if write:
        out = discovered or Path("registry.discovered.toml")
        write_document(out, discovered_document(entries))
        Console(stderr=True).print(f"wrote {len(entries)} entries to {escape(str(out))}")


@registry_app.command()
def snapshot(
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the merged JSON.")],
    registry: RegistryOpt = Path("registry.toml"),
    discovered: DiscoveredOpt = None,
) -> None:
    """Write the merged registry as JSON (sorted, byte-for-byte reproducible)."""
    with _usage_errors():
        merged = load_registry(registry, discovered)
        write_snapshot(merged, out)
    Console(stderr=True).print(f"wrote {len(merged)} entries to {escape(str(out))}")
