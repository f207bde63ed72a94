"""The files index (``FilesStore``): rows scoped to their owner, what counts towards the stored
bytes of a key, retention, batch rows and their result lines, private modes on disk."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import orjson
import pytest

from vlmserve.api.endpoints.files.store import FileRow, FilesStore, LineResult, _wide_ints

NOW = int(time.time())


def row(file_id: str, owner: str = "a", size: int = 10, **kw: object) -> FileRow:
    values: dict[str, object] = {
        "filename": f"{file_id}.jsonl",
        "purpose": "batch",
        "created_at": NOW,
        "expires_at": None,
        **kw,
    }
    return FileRow(file_id, owner, bytes=size, **values)  # type: ignore[arg-type]


def batch(batch_id: str, status: str = "in_progress", created_at: int = NOW) -> dict:
    return {"id": batch_id, "status": status, "created_at": created_at, "object": "batch"}


@pytest.fixture
def store(tmp_path: Path) -> FilesStore:
    return FilesStore(tmp_path / "data")


def test_nothing_is_made_on_disk_until_the_first_write(store: FilesStore) -> None:
    assert not store.exists()
    assert store.file("a", "file-1") is None
    assert store.files("a", None, 10, None, False) == []
    assert store.file_bytes("a") == 0 and store.used_bytes("a") == 0
    assert store.unfinished_count("a") == 0
    assert store.expired(NOW) == ([], [])
    assert store.batch("batch-1") is None and store.batches("a", 10, None) == []
    assert store.unfinished_batches() == [] and store.line_counts("batch-1") == (0, 0)
    assert not store.root.exists()
    store.db()
    assert store.exists() and store.db_path == store.root / "files.db"
    assert store.db_path.is_file()


def test_closing_a_store_that_never_opened_is_a_no_op(store: FilesStore) -> None:
    store.close()
    assert not store.exists()


def test_a_new_store_over_an_existing_database_reads_it(store: FilesStore) -> None:
    store.add_file(row("file-1"))
    store.close()
    store.close()  # twice: no error
    again = FilesStore(store.root)
    assert again.exists()
    assert again.file("a", "file-1") == row("file-1")


def test_database_blobs_and_directories_are_private(store: FilesStore) -> None:
    store.db()
    store.add_file(row("file-1"))
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.blobs).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.db_path).st_mode) == 0o600
    assert store.blobs == store.root / "files" and store.blob("x") == store.blobs / "x"
    assert store.inputs == store.root / "inputs" and store.pinned("b") == store.inputs / "b"
    journal = store.db().execute("PRAGMA journal_mode").fetchone()[0]
    assert journal == "wal"


def test_a_file_is_found_only_by_its_owner_and_until_it_expires(store: FilesStore) -> None:
    store.add_file(row("file-1", "a"))
    store.add_file(row("file-2", "a", expires_at=NOW + 3600))
    store.add_file(row("file-3", "a", expires_at=NOW - 1))
    store.add_file(row("file-4", "a", expires_at=int(time.time())))
    assert store.file("a", "file-1") == row("file-1", "a")
    assert store.file("b", "file-1") is None
    assert store.file("a", "file-2") is not None
    assert store.file("a", "file-3") is None and store.file("a", "file-4") is None
    assert [r.id for r in store.files("a", None, 10, None, False)] == ["file-1", "file-2"]


def test_adding_a_row_again_replaces_it(store: FilesStore) -> None:
    store.add_file(row("file-1", size=10))
    store.add_file(row("file-1", size=25))
    assert store.file("a", "file-1").bytes == 25  # type: ignore[union-attr]
    assert store.file_bytes("a") == 25


def test_listing_is_per_owner_by_purpose_in_order_with_a_cursor(store: FilesStore) -> None:
    for i in range(4):
        store.add_file(row(f"file-{i}", "a", created_at=NOW + i, purpose="batch"))
    store.add_file(row("file-v", "a", created_at=NOW + 9, purpose="vision"))
    store.add_file(row("file-b", "b", created_at=NOW + 1))

    def ids(*args: object) -> list[str]:
        return [r.id for r in store.files("a", *args)]  # type: ignore[arg-type]

    assert ids(None, 10, None, False) == ["file-0", "file-1", "file-2", "file-3", "file-v"]
    assert ids(None, 10, None, True) == ["file-v", "file-3", "file-2", "file-1", "file-0"]
    assert ids("vision", 10, None, False) == ["file-v"]
    assert ids("batch", 2, None, False) == ["file-0", "file-1"]
    assert ids("batch", 10, "file-1", False) == ["file-2", "file-3"]
    assert ids("batch", 10, "file-2", True) == ["file-1", "file-0"]
    # another key's id as the cursor pages exactly as an unknown id does
    assert ids(None, 10, "file-b", False) == ids(None, 10, "file-unknown", False) == []


def test_the_cursor_breaks_ties_of_created_at_by_id(store: FilesStore) -> None:
    for name in ("file-c", "file-a", "file-b"):
        store.add_file(row(name, created_at=NOW))
    assert [r.id for r in store.files("a", None, 10, "file-a", False)] == ["file-b", "file-c"]
    assert [r.id for r in store.files("a", None, 10, "file-c", True)] == ["file-b", "file-a"]


def test_stored_bytes_count_files_and_the_results_of_unfinished_batches(
    store: FilesStore,
) -> None:
    store.add_file(row("file-1", "a", size=100))
    store.add_file(row("file-2", "a", size=50, purpose="batch_output"))
    store.add_file(row("file-3", "b", size=7))
    store.put_batch("a", batch("batch-run"), None)
    store.put_batch("a", batch("batch-done", "completed"), None)
    store.put_batch("b", batch("batch-b"), None)
    result = {"custom_id": "c1", "text": "é"}  # 2 bytes in UTF-8: bytes, not characters
    store.add_line("batch-run", LineResult(1, True, result))
    store.add_line("batch-run", LineResult(2, False, {"e": 1}))
    store.add_line("batch-done", LineResult(1, True, result))
    store.add_line("batch-b", LineResult(1, True, result))
    line_bytes = len(orjson.dumps(result)) + 1 + len(b'{"e":1}') + 1
    assert store.file_bytes("a") == 150
    assert store.used_bytes("a") == 150 + line_bytes
    assert store.used_bytes("b") == 7 + len(orjson.dumps(result)) + 1
    assert store.used_bytes("c") == 0 and store.file_bytes("c") == 0


@pytest.mark.parametrize("status", ["validating", "in_progress", "finalizing", "cancelling"])
def test_each_unfinished_status_counts(store: FilesStore, status: str) -> None:
    store.put_batch("a", batch("batch-1", status), None)
    store.add_line("batch-1", LineResult(1, True, {}))
    assert store.unfinished_count("a") == 1 and store.unfinished_count("b") == 0
    assert store.used_bytes("a") == 3
    assert [b["id"] for _, b in store.unfinished_batches()] == ["batch-1"]


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled", "expired"])
def test_a_finished_batch_neither_counts_nor_runs(store: FilesStore, status: str) -> None:
    store.put_batch("a", batch("batch-1", status), NOW - 1)
    store.add_line("batch-1", LineResult(1, True, {}))
    assert store.unfinished_count("a") == 0 and store.used_bytes("a") == 0
    assert store.unfinished_batches() == []
    assert store.expired(NOW) == ([], ["batch-1"])


def test_retention_finds_expired_files_and_finished_batches_only(store: FilesStore) -> None:
    store.add_file(row("file-old", expires_at=NOW - 5))
    store.add_file(row("file-now", expires_at=NOW))
    store.add_file(row("file-new", expires_at=NOW + 5))
    store.add_file(row("file-kept"))
    store.put_batch("a", batch("batch-old", "completed"), NOW - 5)
    store.put_batch("a", batch("batch-run", "in_progress"), NOW - 5)
    store.put_batch("a", batch("batch-new", "failed"), NOW + 5)
    files, batches = store.expired(NOW + 0.9)
    assert sorted(files) == ["file-now", "file-old"]
    assert batches == ["batch-old"]


def test_deleting_a_file_removes_its_row_and_blob(store: FilesStore) -> None:
    store.add_file(row("file-1"))
    store.blob("file-1").write_bytes(b"x")
    store.delete_file("file-1")
    assert store.file("a", "file-1") is None and not store.blob("file-1").exists()
    store.delete_file("file-1")  # again: no error


def test_a_batch_is_found_only_by_its_owner(store: FilesStore) -> None:
    store.put_batch("a", batch("batch-1"), NOW + 60)
    assert store.batch("batch-1") == ("a", batch("batch-1"))
    assert store.batch("batch-1", "a") == ("a", batch("batch-1"))
    assert store.batch("batch-1", "b") is None
    assert store.batch("batch-2", "a") is None
    stored = store.db().execute("SELECT * FROM batches").fetchone()
    assert stored[:5] == ("batch-1", "a", "in_progress", NOW, NOW + 60)


def test_saving_a_batch_updates_its_status_and_object(store: FilesStore) -> None:
    store.put_batch("a", batch("batch-1"), None)
    store.save_batch({**batch("batch-1", "completed"), "output_file_id": "file-9"})
    assert store.batch("batch-1", "a") == (
        "a",
        {**batch("batch-1", "completed"), "output_file_id": "file-9"},
    )
    assert store.unfinished_count("a") == 0


def test_batches_list_newest_first_per_owner_with_a_cursor(store: FilesStore) -> None:
    for i in range(3):
        store.put_batch("a", batch(f"batch-{i}", created_at=NOW + i), None)
    store.put_batch("b", batch("batch-b", created_at=NOW + 1), None)
    listed = [b["id"] for b in store.batches("a", 10, None)]
    assert listed == ["batch-2", "batch-1", "batch-0"]
    assert [b["id"] for b in store.batches("a", 1, None)] == ["batch-2"]
    assert [b["id"] for b in store.batches("a", 10, "batch-2")] == ["batch-1", "batch-0"]
    assert store.batches("a", 10, "batch-b") == store.batches("a", 10, "batch-x") == []
    runs = [(o, b["id"]) for o, b in store.unfinished_batches()]
    assert runs == [("a", "batch-0"), ("a", "batch-1"), ("b", "batch-b"), ("a", "batch-2")]


def test_deleting_a_batch_removes_its_lines_and_its_pinned_input(store: FilesStore) -> None:
    store.db()
    store.blob("file-1").write_bytes(b"line\n")
    store.put_batch("a", batch("batch-1"), None)
    store.put_batch("a", batch("batch-2"), None)
    store.add_line("batch-1", LineResult(1, True, {}))
    store.add_line("batch-2", LineResult(1, True, {}))
    store.pin("batch-1", "file-1")
    store.delete_batch("batch-1")
    assert store.batch("batch-1") is None and store.done_lines("batch-1") == set()
    assert not store.pinned("batch-1").exists()
    assert store.done_lines("batch-2") == {1}


def test_a_pinned_input_outlives_its_file(store: FilesStore) -> None:
    store.db()
    store.blob("file-1").write_bytes(b"line\n")
    store.pin("batch-1", "file-1")
    store.delete_file("file-1")
    assert store.pinned("batch-1").read_bytes() == b"line\n"
    assert stat.S_IMODE(os.stat(store.inputs).st_mode) == 0o700
    store.unpin("batch-1")
    store.unpin("batch-1")
    assert not store.pinned("batch-1").exists()


def test_a_pin_copies_where_links_fail(store: FilesStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.db()
    store.blob("file-1").write_bytes(b"data")

    def no_link(*args: object) -> None:
        raise OSError("no links here")

    monkeypatch.setattr(os, "link", no_link)
    store.pin("batch-1", "file-1")
    assert store.pinned("batch-1").read_bytes() == b"data"
    assert stat.S_IMODE(os.stat(store.pinned("batch-1")).st_mode) == 0o600
    assert os.stat(store.pinned("batch-1")).st_ino != os.stat(store.blob("file-1")).st_ino


def test_result_lines_are_counted_replaced_and_dumped_in_order(
    store: FilesStore, tmp_path: Path
) -> None:
    store.put_batch("a", batch("batch-1"), None)
    store.add_line("batch-1", LineResult(3, True, {"n": 3}))
    store.add_line("batch-1", LineResult(1, True, {"n": 1}))
    store.add_line("batch-1", LineResult(2, False, {"n": 2}))
    store.add_line("batch-1", LineResult(4, False, {"n": 4}))
    store.add_line("batch-1", LineResult(4, True, {"n": 44}))  # a line run again
    store.add_line("batch-2", LineResult(1, True, {"n": 0}))
    assert store.done_lines("batch-1") == {1, 2, 3, 4}
    assert store.line_counts("batch-1") == (3, 1)
    assert store.line_counts("batch-9") == (0, 0)
    out = tmp_path / "out.jsonl"
    assert store.dump_lines("batch-1", True, out) == len(out.read_bytes())
    assert out.read_bytes() == b'{"n":1}\n{"n":3}\n{"n":44}\n'
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert store.dump_lines("batch-1", False, out) == 8
    assert out.read_bytes() == b'{"n":2}\n'
    assert store.dump_lines("batch-9", True, out) == 0 and out.read_bytes() == b""


def test_results_keep_preserialised_parts_and_integers_wider_than_64_bits(
    store: FilesStore, tmp_path: Path
) -> None:
    fragment = orjson.Fragment(b'{"logprobs":[1.5]}')
    store.add_line("batch-1", LineResult(1, True, {"a": fragment}))
    wide = {
        "big": 2**70,
        "edge": 2**64,
        "flag": True,
        "neg": -(2**63) - 1,
        "ok": [2**64 - 1, -(2**63)],
        "a": fragment,
    }
    store.add_line("batch-1", LineResult(2, True, wide))
    out = tmp_path / "out.jsonl"
    store.dump_lines("batch-1", True, out)
    first, second = out.read_text().splitlines()
    assert first == '{"a":{"logprobs":[1.5]}}'
    assert json.loads(second) == {**wide, "a": {"logprobs": [1.5]}}
    assert '"big":1180591620717411303424,' in second
    with pytest.raises(TypeError):
        store.add_line("batch-1", LineResult(3, True, {"big": 2**70, "x": object()}))


def test_only_integers_orjson_cannot_write_become_fragments() -> None:
    # orjson writes [-2**63, 2**64 - 1] itself; one past either end is written from its text.
    inside = [2**64 - 1, -(2**63), 0, 127, -127, True]
    assert _wide_ints(inside) == inside
    assert all(type(a) is type(b) for a, b in zip(_wide_ints(inside), inside, strict=True))
    outside = _wide_ints({"up": 2**64, "down": -(2**63) - 1})
    assert all(isinstance(v, orjson.Fragment) for v in outside.values())
    assert orjson.dumps(outside) == b'{"up":18446744073709551616,"down":-9223372036854775809}'


def test_a_file_row_is_openai_s_file_object() -> None:
    assert row("file-1", expires_at=NOW + 1).to_wire() == {
        "id": "file-1",
        "object": "file",
        "bytes": 10,
        "created_at": NOW,
        "expires_at": NOW + 1,
        "filename": "file-1.jsonl",
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
    }


async def test_the_store_answers_from_any_thread(store: FilesStore) -> None:
    store.add_file(row("file-1", size=7))  # opened on this thread
    assert await asyncio.to_thread(store.file_bytes, "a") == 7
