"""The durable index of files and batches: one SQLite database (``files.db``) next to the blobs.

    files        one row per file: owner, name, purpose, size, times; its bytes in blobs/<id>
    batches      one row per batch: owner, status and its OpenAI object as JSON
    batch_lines  one row per finished batch line (its output or error line), written as the line
                 finishes: a restarted server runs only the lines that have no row

A batch pins its input file at create (a hard link, ``inputs/<batch id>``, removed when the
batch has finished): deleting the file meanwhile loses none of the batch's lines.

Nothing is created before the first write (``open`` is lazy), so a server that never sees a
file leaves no trace on disk. Everything here is private: files 0600, directories 0700.
The queries are small and indexed; they run on the event loop.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from vlmserve.private import open_private, private_db, private_dir

__all__ = ["FileRow", "FilesStore", "LineResult"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER
);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER, data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, created_at);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, result TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
"""
_UNFINISHED = "('validating', 'in_progress', 'finalizing', 'cancelling')"


@dataclass(slots=True)
class FileRow:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None

    def to_wire(self) -> dict[str, Any]:
        """OpenAI's ``file`` object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@dataclass(slots=True)
class LineResult:
    line: int  # 1-based line number in the input file
    ok: bool  # True: an output line; False: an error line
    result: dict[str, Any]  # the line written to the output or error file


def _wide_ints(value: Any) -> Any:
    """``value`` with each integer orjson cannot write (wider than 64 bits) as a JSON number
    fragment."""
    if isinstance(value, dict):
        return {k: _wide_ints(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_wide_ints(v) for v in value]
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        return orjson.Fragment(str(value).encode())
    return value


def _result_json(result: dict[str, Any]) -> str:
    """A line's result as JSON text, by orjson (which writes the pre-serialised parts of an
    answer as they are); an integer wider than 64 bits is written as the number it is."""
    try:
        return orjson.dumps(result).decode()
    except orjson.JSONEncodeError:
        return orjson.dumps(_wide_ints(result)).decode()


class FilesStore:
    def __init__(self, root: Path):
        self.root = root
        self.blobs = root / "files"
        self.inputs = root / "inputs"
        self.db_path = root / "files.db"
        self._db: sqlite3.Connection | None = None

    def exists(self) -> bool:
        return self._db is not None or self.db_path.is_file()

    def db(self) -> sqlite3.Connection:
        if self._db is None:
            private_dir(self.root)
            private_dir(self.blobs)
            private_db(self.db_path)
            db = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def blob(self, file_id: str) -> Path:
        return self.blobs / file_id

    def pinned(self, batch_id: str) -> Path:
        """The batch's own name for its input file."""
        return self.inputs / batch_id

    def pin(self, batch_id: str, file_id: str) -> None:
        """Give the batch its own name for the input file: a hard link (no copy, the same
        bytes), or a copy where the file system has no links."""
        private_dir(self.inputs)
        target = self.pinned(batch_id)
        try:
            os.link(self.blob(file_id), target)
        except OSError:
            with self.blob(file_id).open("rb") as src, open_private(target) as out:
                shutil.copyfileobj(src, out)

    def unpin(self, batch_id: str) -> None:
        self.pinned(batch_id).unlink(missing_ok=True)

    # -- files ------------------------------------------------------------------------------

    def add_file(self, row: FileRow) -> None:
        self.db().execute(
            "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                row.id,
                row.owner,
                row.filename,
                row.purpose,
                row.bytes,
                row.created_at,
                row.expires_at,
            ),
        )

    def file(self, owner: str, file_id: str) -> FileRow | None:
        if not self.exists():
            return None
        found = (
            self.db()
            .execute(
                "SELECT * FROM files WHERE id = ? AND owner = ? AND "
                "(expires_at IS NULL OR expires_at > ?)",
                (file_id, owner, int(time.time())),
            )
            .fetchone()
        )
        return FileRow(*found) if found else None

    def files(
        self, owner: str, purpose: str | None, limit: int, after: str | None, descending: bool
    ) -> list[FileRow]:
        if not self.exists():
            return []
        sql = "SELECT * FROM files WHERE owner = ? AND (expires_at IS NULL OR expires_at > ?)"
        args: list[Any] = [owner, int(time.time())]
        if purpose:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after:
            op = "<" if descending else ">"
            # the cursor only among the owner's files: another key's id pages as an unknown one
            sql += (
                f" AND (created_at, id) {op} (SELECT created_at, id FROM files WHERE id = ? "
                "AND owner = ?)"
            )
            args += [after, owner]
        order = "DESC" if descending else "ASC"
        sql += f" ORDER BY created_at {order}, id {order} LIMIT ?"
        return [FileRow(*r) for r in self.db().execute(sql, (*args, limit))]

    def file_bytes(self, owner: str) -> int:
        """Bytes of the owner's files (uploads and batch output files)."""
        if not self.exists():
            return 0
        row = self.db().execute("SELECT SUM(bytes) FROM files WHERE owner = ?", (owner,))
        return int(row.fetchone()[0] or 0)

    def used_bytes(self, owner: str) -> int:
        """Bytes the owner stores: its files and the results its unfinished batches hold."""
        if not self.exists():
            return 0
        row = self.db().execute(
            "SELECT SUM(LENGTH(CAST(l.result AS BLOB)) + 1) FROM batch_lines l JOIN batches b "
            f"ON b.id = l.batch_id WHERE b.owner = ? AND b.status IN {_UNFINISHED}",
            (owner,),
        )
        return self.file_bytes(owner) + int(row.fetchone()[0] or 0)

    def unfinished_count(self, owner: str) -> int:
        if not self.exists():
            return 0
        row = self.db().execute(
            f"SELECT COUNT(*) FROM batches WHERE owner = ? AND status IN {_UNFINISHED}", (owner,)
        )
        return int(row.fetchone()[0])

    def delete_file(self, file_id: str) -> None:
        self.db().execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.blob(file_id).unlink(missing_ok=True)

    def expired(self, now: float) -> tuple[list[str], list[str]]:
        """Ids of files and of finished batches whose retention has run out."""
        if not self.exists():
            return [], []
        files = self.db().execute("SELECT id FROM files WHERE expires_at <= ?", (int(now),))
        batches = self.db().execute(
            "SELECT id FROM batches WHERE expires_at <= ? AND status IN "
            "('completed', 'failed', 'cancelled', 'expired')",
            (int(now),),
        )
        return [r[0] for r in files], [r[0] for r in batches]

    # -- batches ----------------------------------------------------------------------------

    def put_batch(self, owner: str, batch: dict[str, Any], expires_at: int | None) -> None:
        self.db().execute(
            "INSERT OR REPLACE INTO batches VALUES (?, ?, ?, ?, ?, ?)",
            (
                batch["id"],
                owner,
                batch["status"],
                batch["created_at"],
                expires_at,
                json.dumps(batch),
            ),
        )

    def save_batch(self, batch: dict[str, Any]) -> None:
        self.db().execute(
            "UPDATE batches SET status = ?, data = ? WHERE id = ?",
            (batch["status"], json.dumps(batch), batch["id"]),
        )

    def batch(self, batch_id: str, owner: str | None = None) -> tuple[str, dict[str, Any]] | None:
        """(owner, the stored batch object) or None (unknown, or another owner's)."""
        if not self.exists():
            return None
        found = (
            self.db()
            .execute("SELECT owner, data FROM batches WHERE id = ?", (batch_id,))
            .fetchone()
        )
        if found is None or (owner is not None and found[0] != owner):
            return None
        return found[0], json.loads(found[1])

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict[str, Any]]:
        if not self.exists():
            return []
        sql, args = "SELECT data FROM batches WHERE owner = ?", [owner]
        if after:
            sql += (
                " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ? "
                "AND owner = ?)"
            )
            args += [after, owner]
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        return [json.loads(r[0]) for r in self.db().execute(sql, (*args, limit))]

    def unfinished_batches(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.exists():
            return []
        rows = self.db().execute(
            f"SELECT owner, data FROM batches WHERE status IN {_UNFINISHED} ORDER BY created_at"
        )
        return [(r[0], json.loads(r[1])) for r in rows]

    def delete_batch(self, batch_id: str) -> None:
        self.unpin(batch_id)
        self.db().execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
        self.db().execute("DELETE FROM batches WHERE id = ?", (batch_id,))

    # -- batch lines ------------------------------------------------------------------------

    def add_line(self, batch_id: str, result: LineResult) -> None:
        self.db().execute(
            "INSERT OR REPLACE INTO batch_lines VALUES (?, ?, ?, ?)",
            (batch_id, result.line, int(result.ok), _result_json(result.result)),
        )

    def done_lines(self, batch_id: str) -> set[int]:
        rows = self.db().execute("SELECT line FROM batch_lines WHERE batch_id = ?", (batch_id,))
        return {r[0] for r in rows}

    def line_counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines so far."""
        if not self.exists():
            return 0, 0
        rows = self.db().execute(
            "SELECT ok, COUNT(*) FROM batch_lines WHERE batch_id = ? GROUP BY ok", (batch_id,)
        )
        counts = dict(rows.fetchall())
        return counts.get(1, 0), counts.get(0, 0)

    def dump_lines(self, batch_id: str, ok: bool, dest: Path) -> int:
        """Write the batch's output (``ok``) or error lines to ``dest`` as JSONL, row by row,
        on a connection of its own; returns the bytes written. Blocking: a worker thread."""
        db = sqlite3.connect(self.db_path)
        size = 0
        try:
            with open_private(dest) as out:
                rows = db.execute(
                    "SELECT result FROM batch_lines WHERE batch_id = ? AND ok = ? ORDER BY line",
                    (batch_id, int(ok)),
                )
                for (result,) in rows:
                    size += out.write(result.encode() + b"\n")
        finally:
            db.close()
        return size
