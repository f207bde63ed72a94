"""Bounds of files and batches, in-process on the tiny Qwen2-VL: batch input files read as a
stream (line ends, BOM, nesting, a deleted input), quotas under concurrent uploads, metadata,
private stored data and listing cursors."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from support_bounds import chat_line, finished, run_batch, serving, upload
from vlmserve.registry.manager import ModelManager

# -- batch input files ------------------------------------------------------------------------


async def test_a_line_with_raw_unicode_line_separators_and_a_bom_runs(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    odd = json.dumps(chat_line("odd", "a\u2028b\u0085c\u2029d"), ensure_ascii=False)
    data = ("\ufeff" + odd + "\r\n" + json.dumps(chat_line("plain")) + "\n").encode()
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        batch = await run_batch(http, data)
        out = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text
    assert batch["status"] == "completed", batch["errors"]
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == ["odd", "plain"]


async def test_a_line_nested_5000_deep_fails_the_batch_as_an_invalid_json_line(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    deep = '{"custom_id": "d", "url": "/v1/chat/completions", "body": ' + "[" * 5000
    data = (json.dumps(chat_line("a")) + "\n" + deep + "]" * 5000 + "}\n").encode()
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        batch = await run_batch(http, data)
    assert batch["status"] == "failed"
    errors = batch["errors"]["data"]
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line")]
    assert "Recursion" not in errors[0]["message"]


async def test_deleting_the_input_file_loses_no_line_of_its_batch(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    lines = [chat_line(f"l{i}", max_tokens=8, ignore_eos=True) for i in range(6)]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        file_id = await upload(http, data, "batch", "in.jsonl")
        made = await http.post(
            "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        )
        assert (await http.delete(f"/v1/files/{file_id}")).status_code == 200
        batch = await finished(http, made.json()["id"])
        out = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text
    assert batch["status"] == "completed", batch["errors"]
    assert len(out.splitlines()) == 6
    assert not any((tmp_path / "inputs").iterdir())  # the pin is gone once the batch finished


# -- quotas -----------------------------------------------------------------------------------

BOUNDARY = "vlmserve-test-boundary"


def _form_head(name: str = "f.jsonl", purpose: str = "batch") -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
        f'{purpose}\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="{name}"\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()


async def chunked_upload(
    http: httpx.AsyncClient, size: int, chunk: int = 16 * 1024, close: bool = True
) -> httpx.Response:
    """A multipart upload sent in pieces, without Content-Length, yielding between pieces."""

    async def body() -> AsyncIterator[bytes]:
        yield _form_head()
        for start in range(0, size, chunk):
            await asyncio.sleep(0.001)
            yield b"x" * min(chunk, size - start)
        if close:
            yield f"\r\n--{BOUNDARY}--\r\n".encode()

    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    return await http.post("/v1/files", content=body(), headers=headers)


async def test_eight_parallel_chunked_uploads_stay_within_the_quota(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    quota = 2**20
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path), files_quota_bytes=quota) as (
        _,
        http,
    ):
        answers = await asyncio.gather(*(chunked_upload(http, 300 * 1024) for _ in range(8)))
        listed = (await http.get("/v1/files")).json()["data"]
    stored = sum(f["bytes"] for f in listed)
    assert stored <= quota, f"{stored} bytes stored against a {quota}-byte quota"
    codes = sorted(a.status_code for a in answers)
    assert codes == [200] * 3 + [413] * 5, [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 413).json()["error"]
    assert refused["code"] == "files_quota_exceeded"
    assert "VLMSERVE_FILES_QUOTA_BYTES" in refused["message"]
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(
        f["id"] for f in listed
    )  # no .part left behind


async def test_an_upload_cut_before_its_closing_boundary_is_refused_and_not_stored(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        answer = await chunked_upload(http, 10_000, close=False)
        listed = (await http.get("/v1/files")).json()["data"]
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "incomplete_upload"
    assert listed == []


async def test_batch_results_count_towards_the_quota_and_a_full_key_gets_no_new_batch(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    lines = [chat_line(f"q{i}", max_tokens=8, ignore_eos=True) for i in range(4)]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    async with serving(
        tiny_dir, chat_models, files_dir=str(tmp_path), files_quota_bytes=len(data) + 512
    ) as (_, http):
        batch = await run_batch(http, data)
        assert batch["status"] == "completed"
        again = await http.post(
            "/v1/batches",
            json={"input_file_id": batch["input_file_id"], "endpoint": "/v1/chat/completions"},
        )
        small = await http.post(
            "/v1/files", files={"file": ("a", b"{}")}, data={"purpose": "batch"}
        )
    assert again.status_code == 400, again.text
    assert again.json()["error"]["code"] == "files_quota_exceeded"
    assert "VLMSERVE_FILES_QUOTA_BYTES" in again.json()["error"]["message"]
    assert small.status_code == 413, small.text


async def test_unfinished_batches_per_key_are_capped(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    lines = [chat_line(f"u{i}", max_tokens=64, ignore_eos=True) for i in range(50)]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path), batch_max_unfinished=1) as (
        _,
        http,
    ):
        file_id = await upload(http, data, "batch", "in.jsonl")
        create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        first = await http.post("/v1/batches", json=create)
        second = await http.post("/v1/batches", json=create)
        await http.post(f"/v1/batches/{first.json()['id']}/cancel")
        await finished(http, first.json()["id"])
        third = await http.post("/v1/batches", json=create)
        await http.post(f"/v1/batches/{third.json()['id']}/cancel")
    assert first.status_code == 200 and third.status_code == 200, third.text
    assert second.status_code == 400, second.text
    assert second.json()["error"]["code"] == "batch_quota_exceeded"
    assert "VLMSERVE_BATCH_MAX_UNFINISHED" in second.json()["error"]["message"]


async def test_batch_metadata_is_held_to_openais_limits(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    cases = [
        ({f"k{i}": "v" for i in range(17)}, 400),
        ({"k" * 65: "v"}, 400),
        ({"k": "v" * 513}, 400),
        ({"k" * 64: "v" * 512}, 200),
    ]
    data = (json.dumps(chat_line("m")) + "\n").encode()
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        file_id = await upload(http, data, "batch", "in.jsonl")
        for metadata, status in cases:
            answer = await http.post(
                "/v1/batches",
                json={
                    "input_file_id": file_id,
                    "endpoint": "/v1/chat/completions",
                    "metadata": metadata,
                },
            )
            assert answer.status_code == status, (list(metadata)[:1], answer.text[:300])
            if status == 200:
                await finished(http, answer.json()["id"])


# -- private data -----------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


async def test_stored_data_is_private_whatever_the_umask(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    data_dir, sessions = tmp_path / "data", tmp_path / "state" / "sessions.db"
    lines = "".join(json.dumps(chat_line(f"p{i}")) + "\n" for i in range(2)).encode()
    old = os.umask(0)
    try:
        async with serving(
            tiny_dir,
            chat_models,
            files_dir=str(data_dir),
            persist_sessions=True,
            sessions_db_path=str(sessions),
        ) as (_, http):
            batch = await run_batch(http, lines)
            stream = await http.post(
                "/v1/chat/completions", json={**chat_line("s")["body"], "stream": True}
            )
            assert stream.status_code == 200
            content = await http.get(f"/v1/files/{batch['output_file_id']}/content")
            found = {
                p: _mode(p) for p in [data_dir, *data_dir.rglob("*"), *sessions.parent.iterdir()]
            }
    finally:
        os.umask(old)
    assert batch["status"] == "completed"
    for suffix in ("", "-wal", "-shm"):
        assert (data_dir / f"files.db{suffix}") in found
        assert sessions.with_name(sessions.name + suffix) in found
    wrong = {str(p): oct(m) for p, m in found.items() if m != (0o700 if p.is_dir() else 0o600)}
    assert wrong == {}
    assert _mode(sessions.parent) == 0o700
    assert content.headers["x-content-type-options"] == "nosniff"
    assert content.headers["content-disposition"].startswith("attachment")


# -- listings -------------------------------------------------------------------------------------


async def test_another_keys_id_as_a_listing_cursor_answers_as_an_unknown_id(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    data = (json.dumps(chat_line("x")) + "\n").encode()
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path), api_keys=["ka", "kb"]) as (
        _,
        http,
    ):
        http.headers.update(a)
        a_file = await upload(http, data, "batch", "a.jsonl")
        a_batch = (
            await http.post(
                "/v1/batches", json={"input_file_id": a_file, "endpoint": "/v1/chat/completions"}
            )
        ).json()["id"]
        await finished(http, a_batch)
        http.headers.update(b)
        for _ in range(3):
            b_file = await upload(http, data, "batch", "b.jsonl")
            made = await http.post(
                "/v1/batches", json={"input_file_id": b_file, "endpoint": "/v1/chat/completions"}
            )
            await finished(http, made.json()["id"])
        pages = {}
        for route, theirs in (("/v1/files", a_file), ("/v1/batches", a_batch)):
            for order in ("asc", "desc"):
                params = {"order": order} if route == "/v1/files" else {}
                real = await http.get(route, params={**params, "after": theirs})
                fake = await http.get(route, params={**params, "after": theirs[:-6] + "000000"})
                pages[route, order] = (real.status_code, real.json(), fake.status_code, fake.json())
    for (route, order), (real_status, real, fake_status, fake) in pages.items():
        assert (real_status, real) == (fake_status, fake), (route, order)


async def test_a_batch_line_with_logprobs_writes_them_in_its_output(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    line = chat_line("lp", max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2)
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        batch = await run_batch(http, (json.dumps(line) + "\n").encode())
        out = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text
    body = json.loads(out)["response"]["body"]
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(item["top_logprobs"]) == 2 for item in content)
