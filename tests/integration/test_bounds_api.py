"""Bounds checked before work, in-process on the tiny Qwen2-VL: media references counted and
sized before a byte of a file is read (each distinct file read once), and text that cannot fit
the context refused before it is tokenised."""

from __future__ import annotations

import json
import time
from pathlib import Path

from support import MODEL
from support_bounds import finished, image_refs, serving, upload
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import image_bytes


async def test_a_file_named_three_times_is_read_once(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (app, http):
        file_id = await upload(http, image_bytes(16, 16), "vision", "a.png")
        store = app.state.services.files.store
        reads: list[str] = []
        blob = store.blob
        store.blob = lambda fid: (reads.append(fid), blob(fid))[1]
        answer = await http.post("/v1/responses", json=image_refs(file_id, file_id, file_id))
    assert answer.status_code == 200, answer.text
    assert reads == [file_id]


async def test_a_file_over_the_media_limit_is_refused_by_its_size_before_it_is_read(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    limits = {"files_dir": str(tmp_path), "max_media_bytes": 4096}
    async with serving(tiny_dir, chat_models, **limits) as (app, http):
        big = await upload(http, b"\x89PNG\r\n\x1a\n" + bytes(8192), "vision", "big.png")
        store = app.state.services.files.store
        reads: list[str] = []
        blob = store.blob
        store.blob = lambda fid: (reads.append(fid), blob(fid))[1]
        answer = await http.post("/v1/responses", json=image_refs(big))
    assert answer.status_code == 413, answer.text
    message = answer.json()["error"]["message"]
    assert big in message and "VLMSERVE_MAX_MEDIA_BYTES" in message
    assert reads == []


async def test_too_many_references_are_refused_before_any_file_is_read(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (app, http):
        file_id = await upload(http, image_bytes(16, 16), "vision", "a.png")
        store = app.state.services.files.store
        reads: list[str] = []
        blob = store.blob
        store.blob = lambda fid: (reads.append(fid), blob(fid))[1]
        answer = await http.post("/v1/responses", json=image_refs(*[file_id] * 9))
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "too_many_media_items"
    assert "VLMSERVE_MAX_MEDIA_PER_REQUEST" in answer.json()["error"]["message"]
    assert reads == []


# -- text that cannot fit -----------------------------------------------------------------------


async def test_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenised(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    # 256 tokens of at most 64 characters each: 16,384 characters; tokenising 4 MiB would take
    # far longer than the refusal
    text = "lorem ipsum " * (4 * 2**20 // 12)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with serving(tiny_dir, chat_models, max_model_len=256) as (_, http):
        started = time.perf_counter()
        answer = await http.post("/v1/chat/completions", json=body)
        seconds = time.perf_counter() - started
        fits = await http.post(
            "/v1/chat/completions",
            json={**body, "messages": [{"role": "user", "content": "lorem " * 20}]},
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "VLMSERVE_MAX_CHARS_PER_TOKEN" in error["message"]
    assert seconds < 1.0
    assert fits.status_code == 200, fits.text


async def test_a_batch_line_naming_a_file_over_the_media_limit_is_refused_by_its_size(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    limits = {"files_dir": str(tmp_path), "max_media_bytes": 4096}
    async with serving(tiny_dir, chat_models, **limits) as (_, http):
        big = await upload(http, b"\x89PNG\r\n\x1a\n" + bytes(8192), "vision", "big.png")
        line = {
            "custom_id": "r",
            "method": "POST",
            "url": "/v1/responses",
            "body": {**image_refs(big), "store": True},
        }
        source = await upload(http, (json.dumps(line) + "\n").encode(), "batch", "in.jsonl")
        made = await http.post(
            "/v1/batches", json={"input_file_id": source, "endpoint": "/v1/responses"}
        )
        batch = await finished(http, made.json()["id"])
        errors = (await http.get(f"/v1/files/{batch['error_file_id']}/content")).text
    error = json.loads(errors)["response"]
    assert error["status_code"] == 413
    assert big in error["body"]["error"]["message"]
    assert "VLMSERVE_MAX_MEDIA_BYTES" in error["body"]["error"]["message"]
