"""Version locks: the sha256 of every artifact file of a local model directory.

What is hashed: every regular file under the directory (symlinks to files are followed,
as in a hub cache snapshot), named by its relative POSIX path. Anything with a path
component starting with ``.`` is skipped: ``.cache/`` and ``.git/`` left by downloads,
``.gitattributes``, and the ``.vlmserve-tiny-complete`` marker of ``vlmserve.testing``.
The aggregate is ``entries.aggregate_digest``: sha256 over sorted ``"<sha256>  <path>\\n"``
lines, so ``sha256sum`` reproduces it.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from vlmserve.errors import ConfigError
from vlmserve.registry.entries import ModelEntry, VersionLock, aggregate_digest

__all__ = [
    "Drift",
    "DriftKind",
    "OnBytes",
    "artifact_files",
    "hash_artifacts",
    "hash_file",
    "local_source",
    "total_bytes",
    "verify",
]

CHUNK = 1 << 20  # 1 MiB: memory stays flat on multi-GB shards
OnBytes = Callable[[int], None]


class DriftKind(str, enum.Enum):
    CHANGED = "changed"
    MISSING = "missing"
    ADDED = "added"


@dataclass(frozen=True, slots=True)
class Drift:
    """One file that differs from the lock; ``expected``/``actual`` are None where absent."""

    path: str
    kind: DriftKind
    expected: str | None
    actual: str | None

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.path} (expected {self.expected}, actual {self.actual})"


def local_source(entry: ModelEntry) -> Path:
    """The entry's weights directory; hub ids and non-hf backends cannot be hashed."""
    if entry.backend != "hf" or not entry.source:
        raise ConfigError(
            f"entry {entry.name!r} (backend {entry.backend!r}) has no local weights to lock"
        )
    path = Path(entry.source).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"source {entry.source!r} of entry {entry.name!r} is not a local directory; "
            "download it and point source at the directory to lock it"
        )
    return path


def artifact_files(root: Path) -> dict[str, Path]:
    """Relative POSIX path -> file, sorted by path, hidden components skipped."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for filename in filenames:
            path = Path(dirpath, filename)
            if not filename.startswith(".") and path.is_file():
                found[path.relative_to(root).as_posix()] = path
    return dict(sorted(found.items()))


def total_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in artifact_files(root).values())


def hash_file(path: Path, on_bytes: OnBytes | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()


def hash_artifacts(
    path: Path, on_bytes: OnBytes | None = None, *, now: datetime | None = None
) -> VersionLock:
    """Hash every artifact under ``path``; ``on_bytes(n)`` reports progress as bytes are read."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory; a version lock hashes a model directory")
    files = {rel: hash_file(file, on_bytes) for rel, file in artifact_files(path).items()}
    if not files:
        raise ConfigError(f"{path} holds no files to lock (hidden files are skipped)")
    stamp = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return VersionLock(
        files=files,
        aggregate_sha256=aggregate_digest(files),
        locked_at=stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
    )


def verify(entry: ModelEntry, on_bytes: OnBytes | None = None) -> list[Drift]:
    """Recompute the entry's artifact hashes; every changed, missing or added file, by path."""
    lock = entry.version_lock
    if lock is None:
        raise ConfigError(
            f"entry {entry.name!r} has no version_lock; run `vlmserve registry lock {entry.name}`"
        )
    present = artifact_files(local_source(entry))
    drifts: list[Drift] = []
    for rel in sorted(lock.files.keys() | present.keys()):
        expected = lock.files.get(rel)
        if rel not in present:
            drifts.append(Drift(rel, DriftKind.MISSING, expected, None))
            continue
        actual = hash_file(present[rel], on_bytes)
        if expected is None:
            drifts.append(Drift(rel, DriftKind.ADDED, None, actual))
        elif actual != expected:
            drifts.append(Drift(rel, DriftKind.CHANGED, expected, actual))
    return drifts
