"""The files service's limits and ownership: the per-upload size limit and the per-key quota on
stored bytes (files, batch results, uploads in flight), reserved atomically while uploads
stream and released when they fail; another key's file is exactly an unknown one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from vlmserve.api.endpoints.files.service import PURPOSES, FilesService, new_file_id
from vlmserve.api.endpoints.files.store import FileRow, FilesStore, LineResult
from vlmserve.api.endpoints.files.upload import FORM_OVERHEAD
from vlmserve.config import Settings
from vlmserve.errors import InvalidRequest, NotFound, PayloadTooLarge

MiB = 2**20
BOUNDARY = "qu0ta"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
QUOTA_MESSAGE = (
    "this upload ({adding}) would take this API key's stored data (files, batch results and "
    "uploads in progress) to {total}, over its quota of {quota} (VLMSERVE_FILES_QUOTA_BYTES); "
    "delete files (DELETE /v1/files/{{id}}) first"
)


def form(data: bytes, purpose: str = "batch", filename: str = "in.jsonl") -> bytes:
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"'
        "\r\n\r\n"
    )
    return head.encode() + data + f"\r\n--{BOUNDARY}--\r\n".encode()


async def pieces(body: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    """The body in pieces, yielding to the loop between them (as a socket does)."""
    for i in range(0, len(body), size):
        yield body[i : i + size]
        await asyncio.sleep(0)


def service(
    tmp_path: Path, *, max_bytes: int = MiB, quota: int = 0, ttl: float = 0
) -> FilesService:
    return FilesService(
        FilesStore(tmp_path / "data"), max_bytes=max_bytes, quota_bytes=quota, ttl=ttl
    )


async def upload(files: FilesService, owner: str, data: bytes, **kw: str) -> dict:
    body = form(data, **kw)
    return await files.upload(owner, CONTENT_TYPE, str(len(body)), pieces(body))


def add_file(files: FilesService, owner: str, size: int, file_id: str | None = None) -> str:
    file_id = file_id or new_file_id()
    files.store.add_file(FileRow(file_id, owner, "f", "batch", size, int(time.time()), None))
    return file_id


def test_settings_make_the_service() -> None:
    settings = Settings(files_max_bytes=5 * MiB, files_quota_bytes=7 * MiB, files_ttl_seconds=60)
    files = FilesService.from_settings(settings)
    assert (files.max_bytes, files.quota_bytes, files.ttl) == (5 * MiB, 7 * MiB, 60)
    assert files.store.root == settings.files_path
    assert files.expires_at(1000) == 1060
    assert service(Path("/unused")).expires_at(1000) is None


def test_file_ids_are_new_each_time() -> None:
    ids = {new_file_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("file-") and len(i) == 37 for i in ids)
    assert PURPOSES == ("batch", "vision", "user_data")


async def test_an_upload_is_stored_owned_and_charged(tmp_path: Path) -> None:
    files = service(tmp_path, quota=MiB)
    made = await upload(files, "a", b"x" * 5000, purpose="vision", filename="dir\\p.png")
    assert made["bytes"] == 5000 and made["purpose"] == "vision" and made["filename"] == "p.png"
    assert made["expires_at"] is None and made["object"] == "file"
    assert files.path("a", made["id"]).read_bytes() == b"x" * 5000
    assert files.used("a") == 5000 and files.used("b") == 0
    assert files._pending == {}
    assert files.retrieve("a", made["id"]) == made
    assert not list(files.store.blobs.glob("*.part"))


async def test_an_upload_expires_after_the_ttl(tmp_path: Path) -> None:
    files = service(tmp_path, ttl=3600)
    made = await upload(files, "a", b"x")
    assert made["expires_at"] == made["created_at"] + 3600


async def test_another_keys_file_is_exactly_an_unknown_one(tmp_path: Path) -> None:
    files = service(tmp_path)
    made = await upload(files, "a", b"secret")

    def refusal(owner: str, file_id: str) -> tuple:
        with pytest.raises(NotFound) as caught:
            files.get(owner, file_id, "input_file_id")
        e = caught.value
        return e.message.replace(file_id, "ID"), e.param, e.code, e.status_code

    assert refusal("b", made["id"]) == refusal("b", new_file_id())
    assert refusal("b", made["id"]) == (
        "no file 'ID' (unknown, deleted, expired, or another API key's)",
        "input_file_id",
        "file_not_found",
        404,
    )
    for call in (files.retrieve, files.path, files.read_text, files.delete):
        with pytest.raises(NotFound):
            call("b", made["id"])
    with pytest.raises(NotFound) as caught:
        files.get("a", "f" * 129)
    assert caught.value.param is None
    assert files.read_text("a", made["id"]) == "secret"
    with pytest.raises(NotFound) as caught:
        files.read_text("b", made["id"], "input_file_id")
    assert caught.value.param == "input_file_id"
    assert files.list("b", None, 10, None, "asc")["data"] == []
    assert files.delete("a", made["id"]) == {"id": made["id"], "object": "file", "deleted": True}
    with pytest.raises(NotFound):
        files.get("a", made["id"])
    assert not files.store.blob(made["id"]).exists()


def test_an_id_is_looked_up_only_up_to_128_characters(tmp_path: Path) -> None:
    files = service(tmp_path)
    long_id, too_long = "f" * 128, "g" * 129
    add_file(files, "a", 1, long_id)
    add_file(files, "a", 1, too_long)  # never made by an upload; refused unread
    assert files.get("a", long_id).id == long_id
    with pytest.raises(NotFound):
        files.get("a", too_long)


async def test_listing_pages_with_has_more_and_cursors(tmp_path: Path) -> None:
    files = service(tmp_path)
    ids = [add_file(files, "a", 1, f"file-{i}") for i in range(3)]
    first = files.list("a", None, 2, None, "asc")
    assert [f["id"] for f in first["data"]] == ids[:2]
    assert (first["has_more"], first["first_id"], first["last_id"]) == (True, ids[0], ids[1])
    assert first["object"] == "list"
    rest = files.list("a", "batch", 2, first["last_id"], "asc")
    assert [f["id"] for f in rest["data"]] == ids[2:] and rest["has_more"] is False
    newest = files.list("a", None, 5, None, "desc")
    assert [f["id"] for f in newest["data"]] == ids[::-1]
    exactly = files.list("a", None, 3, None, "asc")
    assert len(exactly["data"]) == 3 and exactly["has_more"] is False
    empty = files.list("a", "vision", 5, None, "asc")
    assert empty == {
        "object": "list",
        "data": [],
        "has_more": False,
        "first_id": None,
        "last_id": None,
    }


def test_the_declared_length_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    files = service(tmp_path, max_bytes=1000, quota=3000)
    add_file(files, "a", 1500)
    files.check_length("a", None)
    files.check_length("a", "-5")
    files.check_length("a", "lots")
    files.check_length("a", str(FORM_OVERHEAD + 1000))  # at the limit
    with pytest.raises(PayloadTooLarge) as caught:
        files.check_length("a", str(FORM_OVERHEAD + 1001))
    assert caught.value.message == (
        "the file is larger than 1000 bytes (VLMSERVE_FILES_MAX_BYTES); split it into smaller files"
    )
    assert caught.value.param == "file" and caught.value.status_code == 413
    big = service(tmp_path / "2", max_bytes=10 * MiB, quota=3 * MiB)
    add_file(big, "a", MiB)
    big.check_length("a", str(FORM_OVERHEAD + 2 * MiB))  # exactly the quota
    big.check_length("b", str(FORM_OVERHEAD + 3 * MiB))
    with pytest.raises(PayloadTooLarge) as caught:
        big.check_length("a", str(FORM_OVERHEAD + 2 * MiB + 1))
    assert caught.value.message == QUOTA_MESSAGE.format(
        adding="2.0 MiB", total="3.0 MiB", quota="3.0 MiB"
    )
    assert (caught.value.param, caught.value.code) == ("file", "files_quota_exceeded")
    service(tmp_path / "3", max_bytes=10 * MiB).check_length("a", str(9 * MiB))  # no quota


def test_new_work_is_refused_once_the_quota_is_used_up(tmp_path: Path) -> None:
    files = service(tmp_path, quota=2 * MiB)
    add_file(files, "a", 2 * MiB - 1)
    files.check_room("a")
    add_file(files, "a", 1)
    with pytest.raises(InvalidRequest) as caught:
        files.check_room("a")
    assert caught.value.message == (
        "this API key stores 2.0 MiB (files and batch results), its whole quota of 2.0 MiB "
        "(VLMSERVE_FILES_QUOTA_BYTES); delete files (DELETE /v1/files/{id}) first"
    )
    assert caught.value.code == "files_quota_exceeded" and caught.value.status_code == 400
    files.check_room("b")
    unlimited = service(tmp_path / "2")
    add_file(unlimited, "a", 5 * MiB)
    unlimited.check_room("a")


def test_the_quota_counts_the_results_of_running_batches(tmp_path: Path) -> None:
    files = service(tmp_path, quota=1000)
    files.store.put_batch("a", {"id": "batch-1", "status": "in_progress", "created_at": 1}, None)
    files.store.add_line("batch-1", LineResult(1, True, {"pad": "r" * 989}))  # 1000 bytes
    assert files.used("a") == 1000
    with pytest.raises(InvalidRequest):
        files.check_room("a")
    charge, release = files._charger("a")
    with pytest.raises(PayloadTooLarge):
        charge(1)
    release()


def test_charges_hold_bytes_until_released_and_refuse_past_the_quota(tmp_path: Path) -> None:
    files = service(tmp_path, max_bytes=600, quota=1000)
    add_file(files, "a", 100)
    first, release_first = files._charger("a")
    second, release_second = files._charger("a")
    first(300)
    first(300)  # 600: the size limit
    assert files.used("a") == 700 and files._pending == {"a": 600}
    with pytest.raises(PayloadTooLarge) as caught:
        first(1)
    assert "VLMSERVE_FILES_MAX_BYTES" in caught.value.message and caught.value.param == "file"
    second(300)  # 100 + 600 + 300 = 1000: the quota
    with pytest.raises(PayloadTooLarge) as caught:
        second(1)
    assert caught.value.message == QUOTA_MESSAGE.format(
        adding="0.0 MiB", total="0.0 MiB", quota="0.0 MiB"
    )
    assert files._pending == {"a": 900}
    release_first()
    assert files._pending == {"a": 300} and files.used("a") == 400
    second(300)  # 600: its own size limit
    assert files._pending == {"a": 600}
    release_second()
    assert files._pending == {} and files.used("a") == 100
    other, release_other = files._charger("b")
    other(600)
    release_other()
    assert files._pending == {}


def test_an_over_quota_message_counts_the_whole_upload_and_what_is_stored(
    tmp_path: Path,
) -> None:
    files = service(tmp_path, max_bytes=10 * MiB, quota=4 * MiB)
    add_file(files, "a", 2 * MiB)
    charge, release = files._charger("a")
    charge(MiB)
    with pytest.raises(PayloadTooLarge) as caught:
        charge(MiB + 1)
    # this upload: 1 MiB held + 1 MiB refused; stored 2 MiB; in all 4 MiB (and one byte)
    assert caught.value.message == QUOTA_MESSAGE.format(
        adding="2.0 MiB", total="4.0 MiB", quota="4.0 MiB"
    )
    release()


def test_a_release_leaves_the_other_uploads_holds(tmp_path: Path) -> None:
    files = service(tmp_path, quota=10_000)
    charge, release = files._charger("a")
    files._pending["a"] = 1  # another upload's hold
    charge(20)
    release()
    assert files._pending == {"a": 1}
    _, release_it = files._charger("a")
    release_it()  # nothing held: the other hold stays
    assert files._pending == {"a": 1}


async def test_parallel_uploads_of_one_key_never_pass_the_quota_together(tmp_path: Path) -> None:
    files = service(tmp_path, max_bytes=MiB, quota=100_000)
    data = b"y" * 30_000
    results = await asyncio.gather(
        *(upload(files, "a", data) for _ in range(8)), return_exceptions=True
    )
    stored = [r for r in results if isinstance(r, dict)]
    refused = [r for r in results if isinstance(r, PayloadTooLarge)]
    assert len(stored) == 3 and len(refused) == 5, results
    assert files.store.file_bytes("a") == 90_000 <= files.quota_bytes
    assert files._pending == {}
    assert sorted(p.name for p in files.store.blobs.iterdir()) == sorted(r["id"] for r in stored)


async def test_a_failed_upload_releases_its_hold_and_leaves_no_part(tmp_path: Path) -> None:
    files = service(tmp_path, quota=10_000)
    with pytest.raises(InvalidRequest) as caught:
        await upload(files, "a", b"z" * 3000, purpose="fine-tune")
    assert caught.value.message == ("purpose 'fine-tune' is not one of batch, vision, user_data")
    assert caught.value.param == "purpose"
    with pytest.raises(InvalidRequest) as caught:
        await files.upload("a", CONTENT_TYPE, None, pieces(form(b"z" * 3000)[:-10]))
    assert caught.value.code == "incomplete_upload"
    with pytest.raises(InvalidRequest) as caught:
        await files.upload("a", CONTENT_TYPE, None, pieces(b"xx--" + BOUNDARY.encode()))
    assert caught.value.message.startswith("the multipart form cannot be read: ")
    with pytest.raises(PayloadTooLarge):
        await upload(files, "a", b"z" * 20_000)
    assert files._pending == {} and files.used("a") == 0
    assert list(files.store.blobs.iterdir()) == []
    made = await upload(files, "a", b"z" * 10_000)  # the whole quota is still there
    assert made["bytes"] == 10_000


async def test_an_upload_is_refused_by_its_length_before_it_is_read(tmp_path: Path) -> None:
    files = service(tmp_path, max_bytes=1000)
    read = []

    async def body() -> AsyncIterator[bytes]:
        read.append(True)
        yield form(b"x")

    length = str(FORM_OVERHEAD + 5000)
    with pytest.raises(PayloadTooLarge):
        await files.upload("a", CONTENT_TYPE, length, body())
    assert read == []


async def test_batch_results_are_written_and_counted_even_over_quota(tmp_path: Path) -> None:
    files = service(tmp_path, quota=10, ttl=60)
    store = files.store
    store.put_batch("a", {"id": "batch-1", "status": "in_progress", "created_at": 1}, None)
    store.add_line("batch-1", LineResult(1, True, {"out": "x" * 20}))
    store.add_line("batch-1", LineResult(2, False, {"err": 1}))
    assert await files.write_results("a", "file-out", "out.jsonl", "batch-1", True)
    row = files.get("a", "file-out")
    assert (row.purpose, row.filename, row.bytes) == ("batch_output", "out.jsonl", 31)
    assert row.expires_at == row.created_at + 60
    assert files.read_text("a", "file-out") == '{"out":"' + "x" * 20 + '"}\n'
    assert not await files.write_results("a", "file-none", "e.jsonl", "batch-2", False)
    with pytest.raises(NotFound):
        files.get("a", "file-none")
    assert not list(store.blobs.glob("*.part"))
    store.save_batch({"id": "batch-1", "status": "completed", "created_at": 1})
    assert files.used("a") == 31  # the results now count once, as the output file


def test_the_sweep_deletes_what_outlived_its_retention(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = service(tmp_path, ttl=60)
    now = int(time.time())
    for file_id, expires in (("file-old", now - 1), ("file-new", now + 60)):
        files.store.add_file(FileRow(file_id, "a", "f", "batch", 1, now, expires))
        files.store.blob(file_id).write_bytes(b"x")
    files.store.put_batch("a", {"id": "batch-old", "status": "failed", "created_at": 1}, now - 1)
    caplog.set_level("INFO", logger="vlmserve.api.endpoints.files.service")
    files.sweep()
    assert not files.store.blob("file-old").exists() and files.store.blob("file-new").exists()
    assert files.store.batch("batch-old") is None
    assert "retention: deleted 1 files and 1 batches" in caplog.text
    caplog.clear()
    files.sweep()
    assert caplog.text == ""
    keeper = service(tmp_path)  # no ttl: nothing is swept
    keeper.store.add_file(FileRow("file-x", "a", "f", "batch", 1, now, now - 5))
    keeper.sweep()
    assert keeper.store.db().execute("SELECT COUNT(*) FROM files WHERE id = 'file-x'").fetchone()[0]


def test_a_file_that_is_not_utf8_reads_with_replacement_characters(tmp_path: Path) -> None:
    files = service(tmp_path)
    file_id = add_file(files, "a", 4)
    files.store.blob(file_id).write_bytes(b"ok\xff\xfe")
    assert files.read_text("a", file_id) == "ok\ufffd\ufffd"


def test_one_upload_may_fill_the_quota_to_the_byte(tmp_path: Path) -> None:
    files = service(tmp_path, quota=1000)
    charge, release = files._charger("a")
    charge(1000)
    with pytest.raises(PayloadTooLarge):
        charge(1)
    release()


async def test_the_quota_counts_what_the_uploading_key_already_stores(tmp_path: Path) -> None:
    files = service(tmp_path, quota=10_000)
    add_file(files, "a", 9000)
    read = []

    async def body() -> AsyncIterator[bytes]:
        read.append(True)
        yield form(b"x")

    with pytest.raises(PayloadTooLarge) as caught:  # by the declared length, unread
        await files.upload("a", CONTENT_TYPE, str(FORM_OVERHEAD + 2000), body())
    assert caught.value.code == "files_quota_exceeded" and read == []
    with pytest.raises(PayloadTooLarge) as caught:  # no length: while it streams
        await files.upload("a", CONTENT_TYPE, None, pieces(form(b"x" * 2000)))
    assert caught.value.code == "files_quota_exceeded"
    assert (await upload(files, "b", b"x" * 2000))["bytes"] == 2000  # another key's quota


async def test_a_form_without_a_purpose_is_refused(tmp_path: Path) -> None:
    files = service(tmp_path)
    body = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
        f"x\r\n--{BOUNDARY}--\r\n"
    ).encode()
    with pytest.raises(InvalidRequest) as caught:
        await files.upload("a", CONTENT_TYPE, None, pieces(body))
    assert caught.value.message == "purpose '' is not one of batch, vision, user_data"
    assert list(files.store.blobs.iterdir()) == []


def test_the_sweep_goes_on_past_a_blob_it_cannot_delete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = service(tmp_path, ttl=60)
    now = int(time.time())
    for file_id in ("file-1", "file-2"):
        files.store.add_file(FileRow(file_id, "a", "f", "batch", 1, now, now - 1))
    files.store.blob("file-1").mkdir(parents=True)  # unlink fails: a directory
    files.store.blob("file-2").write_bytes(b"x")
    caplog.set_level("INFO", logger="vlmserve.api.endpoints.files.service")
    files.sweep()
    assert not files.store.blob("file-2").exists()
    assert files.store.expired(now + 10) == ([], [])
    assert [r.getMessage() for r in caplog.records] == ["retention: deleted 2 files and 0 batches"]
