"""Where tiny checkpoints live, and how a build lands there without a half-written directory.

A build writes into a fresh temporary directory beside its target, writes ``MARKER``
last, then renames the directory into place. A directory that exists under its final
name is therefore complete; two processes racing on the same target both build, the
first rename wins and the loser throws its copy away.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["MARKER", "build_atomically", "cache_root", "is_complete", "short_hash"]

logger = logging.getLogger(__name__)

MARKER = ".vlmserve-tiny-complete"


def cache_root() -> Path:
    """``$VLMSERVE_TINY_CACHE``, else ``~/.cache/vlmserve/tiny`` (read per call, not at import)."""
    configured = os.environ.get("VLMSERVE_TINY_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "vlmserve" / "tiny"


def short_hash(payload: object) -> str:
    """A stable 12-hex-digit hash of a JSON-serialisable value."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def is_complete(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def build_atomically(target: Path, build: Callable[[Path], None], *, what: str) -> Path:
    """Return ``target``, running ``build(tmp_dir)`` and renaming it into place if not yet built."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    started = time.perf_counter()
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps({"what": what}) + "\n")
        try:
            os.replace(tmp, target)  # atomic; fails if target exists and is not empty
        except OSError:
            if is_complete(target):  # another process won the race: use its copy
                return target
            raise FileExistsError(
                f"{target} exists but is not a complete tiny checkpoint (no {MARKER}); "
                "delete it or pass another out_dir"
            ) from None
        logger.info("built %s in %.1f s: %s", what, time.perf_counter() - started, target)
        return target
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
