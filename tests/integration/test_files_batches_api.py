"""/v1/files and /v1/batches with the official ``openai`` client, in-process on the tiny Qwen2-VL
(and the tiny VLM2Vec-style embedder for an embeddings batch)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.registry.build import hf_handle
from vlmserve.registry.manager import ModelManager
from vlmserve.testing import build_lora_adapter
from vlmserve.testing.media import data_url, image_bytes

EMBED = "tiny-embed"
IMAGE = data_url(image_bytes(32, 32), "image/png")


@contextlib.asynccontextmanager
async def serving(
    tiny_dir: Path, models: ModelManager, **settings: Any
) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The app in-process (its lifespan running) and an httpx client on it."""
    app = build_app(make_settings(tiny_dir, **settings), models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            yield app, c


def client(http: httpx.AsyncClient, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key=key, http_client=http, max_retries=0)


def chat_line(custom_id: str, image: bool = False, **body: Any) -> dict[str, Any]:
    content: Any = f"Say {custom_id}."
    if image:
        content = [
            {"type": "image_url", "image_url": {"url": IMAGE}},
            {"type": "text", "text": content},
        ]
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        **body,
    }
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": request,
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def run_batch(
    api: openai.AsyncOpenAI, data: bytes, endpoint: str = "/v1/chat/completions"
) -> Any:
    source = await api.files.create(file=("in.jsonl", data), purpose="batch")
    batch = await api.batches.create(
        input_file_id=source.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )
    return await finished(api, batch.id)


async def finished(api: openai.AsyncOpenAI, batch_id: str, timeout: float = 300) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while (batch := await api.batches.retrieve(batch_id)).status not in (
        "completed",
        "failed",
        "cancelled",
        "expired",
    ):
        assert asyncio.get_running_loop().time() < deadline, f"batch stuck in {batch.status}"
        await asyncio.sleep(0.05)
    return batch


async def lines_of(api: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await api.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


# -- files ------------------------------------------------------------------------------------


async def test_a_file_is_uploaded_listed_retrieved_read_and_deleted(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        api = client(http)
        made = await api.files.create(file=("notes.jsonl", b'{"a": 1}\n'), purpose="user_data")
        assert made.object == "file" and made.id.startswith("file-")
        assert (made.bytes, made.filename, made.purpose) == (9, "notes.jsonl", "user_data")
        assert made.status == "processed" and made.created_at > 0
        assert [f.id for f in (await api.files.list()).data] == [made.id]
        assert (await api.files.retrieve(made.id)).filename == "notes.jsonl"
        assert (await api.files.content(made.id)).content == b'{"a": 1}\n'
        deleted = await api.files.delete(made.id)
        assert deleted.deleted and deleted.id == made.id
        with pytest.raises(openai.NotFoundError):
            await api.files.retrieve(made.id)
        assert (await api.files.list()).data == []


async def test_a_bad_purpose_is_a_400_and_nothing_is_kept(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await client(http).files.create(file=("x", b"x"), purpose="fine-tune")
        assert list((tmp_path / "files").iterdir()) == []


async def test_a_file_over_the_size_limit_is_a_413_before_it_is_stored(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path), files_max_bytes=100_000) as (
        _,
        http,
    ):
        api = client(http)
        with pytest.raises(openai.APIStatusError, match="VLMSERVE_FILES_MAX_BYTES") as caught:
            await api.files.create(file=("big.bin", b"x" * 200_000), purpose="batch")
        assert caught.value.status_code == 413

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: refused as it streams
            yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="f"\r\n\r\n'
            for _ in range(100):
                yield b"y" * 4096
            yield b"\r\n--b--\r\n"

        form = {"content-type": "multipart/form-data; boundary=b"}
        r = await http.post("/v1/files", content=chunked(), headers=form)
        assert r.status_code == 413 and r.json()["error"]["param"] == "file", r.text
        assert (await api.files.list()).data == []
        assert [p.name for p in (tmp_path / "files").iterdir()] == []


async def test_the_quota_of_a_key_is_a_413_naming_the_setting(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(
        tiny_dir,
        chat_models,
        files_dir=str(tmp_path),
        api_keys=["k1", "k2"],
        files_quota_bytes=3000,
    ) as (_, http):
        one, two = client(http, "k1"), client(http, "k2")
        await one.files.create(file=("a", b"a" * 2000), purpose="vision")
        with pytest.raises(openai.APIStatusError, match="VLMSERVE_FILES_QUOTA_BYTES") as caught:
            await one.files.create(file=("b", b"b" * 2000), purpose="vision")
        assert caught.value.status_code == 413
        assert caught.value.body["code"] == "files_quota_exceeded"  # type: ignore[index]
        await two.files.create(file=("c", b"c" * 2000), purpose="vision")  # its own quota


async def test_files_and_batches_belong_to_the_key_that_made_them(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path), api_keys=["k1", "k2"]) as (
        _,
        http,
    ):
        one, two = client(http, "k1"), client(http, "k2")
        made = await one.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
        batch = await one.batches.create(
            input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        for call in (two.files.retrieve, two.files.content, two.files.delete):
            with pytest.raises(openai.NotFoundError):
                await call(made.id)
        with pytest.raises(openai.NotFoundError):
            await two.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            await two.batches.cancel(batch.id)
        with pytest.raises(openai.NotFoundError):  # another key's file as a batch's input
            await two.batches.create(
                input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert (await two.files.list()).data == [] and (await two.batches.list()).data == []
        assert [b.id for b in (await one.batches.list()).data] == [batch.id]
        assert (await finished(one, batch.id)).status == "completed"


async def test_files_expire_after_the_retention_time(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path), files_ttl_seconds=1) as (
        _,
        http,
    ):
        api = client(http)
        made = await api.files.create(file=("a", b"a"), purpose="user_data")
        assert made.expires_at is not None and made.expires_at <= made.created_at + 1
        await asyncio.sleep(2.1)
        with pytest.raises(openai.NotFoundError):
            await api.files.retrieve(made.id)
        await api.files.create(file=("b", b"b"), purpose="user_data")  # an upload sweeps
        assert not (tmp_path / "files" / made.id).exists()


# -- batches ----------------------------------------------------------------------------------


async def test_a_batch_of_50_chat_lines_gives_48_results_and_2_errors(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    lines = [chat_line(f"req-{i}", image=i % 5 == 0) for i in range(50)]
    lines[7]["body"]["messages"] = []  # invalid: no messages
    lines[31]["body"]["temperature"] = "hot"  # invalid: not a number
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path), batch_max_concurrency=4) as (
        _,
        http,
    ):
        api = client(http)
        batch = await run_batch(api, jsonl(lines))
        assert batch.status == "completed", batch.errors
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (50, 48, 2)
        outputs = await lines_of(api, batch.output_file_id)
        errors = await lines_of(api, batch.error_file_id)
    wanted = [line["custom_id"] for i, line in enumerate(lines) if i not in (7, 31)]
    assert [o["custom_id"] for o in outputs] == wanted  # in the input's order
    for out in outputs:
        assert out["error"] is None and out["response"]["status_code"] == 200
        body = out["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 4
    assert (
        outputs[0]["response"]["body"]["usage"]["prompt_tokens"]
        > outputs[1]["response"]["body"]["usage"]["prompt_tokens"]
    )  # req-0 has the image
    assert [e["custom_id"] for e in errors] == ["req-7", "req-31"]
    for err in errors:
        assert err["response"]["status_code"] == 400
        assert err["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert "messages" in errors[0]["error"]["message"]
    assert "temperature" in errors[1]["error"]["message"]


async def test_an_input_file_that_is_not_jsonl_fails_the_batch_with_its_line_numbers(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    good = json.dumps(chat_line("a"))
    data = f"{good}\nthis is not json\n{json.dumps({'method': 'POST'})}\n".encode()
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        batch = await run_batch(client(http), data)
    assert batch.status == "failed" and batch.errors is not None
    found = [(e.line, e.code) for e in batch.errors.data or []]
    assert found == [(2, "invalid_json_line"), (3, "missing_custom_id")]
    assert "line 2 is not valid JSON" in (batch.errors.data or [])[0].message  # type: ignore[operator]
    assert batch.output_file_id is None and batch.request_counts.completed == 0


async def test_cancel_stops_a_batch_and_keeps_the_results_so_far(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    lines = [chat_line(f"c-{i}", max_tokens=8) for i in range(40)]
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (app, http):
        api = client(http)
        done: list[str] = []
        app.state.services.batches.on_line = lambda _, custom_id: done.append(custom_id)
        source = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await api.batches.create(
            input_file_id=source.id, completion_window="24h", endpoint="/v1/chat/completions"
        )
        while len(done) < 2:
            await asyncio.sleep(0.02)
        cancelling = await api.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        batch = await finished(api, batch.id, timeout=30)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        outputs = await lines_of(api, batch.output_file_id)
        assert 2 <= len(outputs) < 40 and batch.request_counts.completed == len(outputs)
        await asyncio.sleep(0.3)
        assert len(done) == len(outputs)  # nothing ran after the cancel


async def test_a_batch_resumes_after_a_restart_without_redoing_finished_lines(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    lines = [chat_line(f"r-{i}", max_tokens=16, ignore_eos=True) for i in range(12)]
    first: list[str] = []
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (app, http):
        app.state.services.batches.on_line = lambda _, custom_id: first.append(custom_id)
        api = client(http)
        source = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await api.batches.create(
            input_file_id=source.id, completion_window="24h", endpoint="/v1/chat/completions"
        )
        while len(first) < 4:
            await asyncio.sleep(0.01)
    # the server stopped mid-way (its runner cancelled); a new one on the same data directory
    second: list[str] = []
    app = build_app(make_settings(tiny_dir, files_dir=str(tmp_path)), models=chat_models)
    app.state.services.batches.on_line = lambda _, custom_id: second.append(custom_id)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            api = client(c)
            batch = await finished(api, batch.id)
            outputs = await lines_of(api, batch.output_file_id)
    assert batch.status == "completed" and batch.request_counts.completed == 12
    assert 4 <= len(first) < 12 and set(first).isdisjoint(second)
    assert sorted(first + second) == sorted(line["custom_id"] for line in lines)
    assert [o["custom_id"] for o in outputs] == [line["custom_id"] for line in lines]


async def test_a_batch_past_its_completion_window_expires_with_the_rest_as_errors(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    # far more work than the 2 s window holds on any CPU (~10 s at 1 ms a token); what is
    # left when it ends is not run, so the test stays short
    lines = [chat_line(f"x-{i}", max_tokens=64, ignore_eos=True) for i in range(160)]
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (app, http):
        app.state.services.batches.window_seconds["24h"] = 2
        api = client(http)
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            await api.batches.create(
                input_file_id="file-x", endpoint="/v1/chat/completions", completion_window="48h"
            )  # type: ignore[arg-type]
        batch = await run_batch(api, jsonl(lines))
        outputs = await lines_of(api, batch.output_file_id)
        errors = await lines_of(api, batch.error_file_id)
    assert batch.status == "expired" and batch.expired_at is not None
    assert batch.expired_at <= batch.expires_at + 2  # type: ignore[operator]
    counts = batch.request_counts
    assert counts.total == 160 and counts.completed == len(outputs) < 160
    assert counts.failed == len(errors) == 160 - len(outputs)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert all(e["response"] is None for e in errors)
    ids = [line["custom_id"] for line in lines]
    assert sorted(o["custom_id"] for o in outputs + errors) == sorted(ids)


async def test_a_batch_whose_window_ended_while_the_server_was_down_expires_on_start(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    lines = [chat_line(f"d-{i}", max_tokens=16, ignore_eos=True) for i in range(12)]
    first: list[str] = []
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (app, http):
        app.state.services.batches.window_seconds["24h"] = 3
        app.state.services.batches.on_line = lambda _, custom_id: first.append(custom_id)
        api = client(http)
        source = await api.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await api.batches.create(
            input_file_id=source.id, completion_window="24h", endpoint="/v1/chat/completions"
        )
        while not first:
            await asyncio.sleep(0.01)
    await asyncio.sleep(3.2)  # the window ends while no server runs
    second: list[str] = []
    app = build_app(make_settings(tiny_dir, files_dir=str(tmp_path)), models=chat_models)
    app.state.services.batches.on_line = lambda _, custom_id: second.append(custom_id)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            batch = await finished(client(c), batch.id)
            errors = await lines_of(client(c), batch.error_file_id)
    assert batch.status == "expired" and second == []  # nothing ran after the window
    assert batch.request_counts.completed == len(first) and len(errors) == 12 - len(first)


# -- an embeddings batch ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_embedder(tiny_dir: Path, chat_models: ModelManager) -> Iterator[ModelManager]:
    cfg = ModelConfig(
        name=EMBED,
        source=str(tiny_dir),
        roles=["embedding"],
        adapter=str(build_lora_adapter(tiny_dir)),
    )
    embedder = hf_handle(cfg, Settings(device="cpu"))
    embedder.backend.load()
    yield ModelManager([*chat_models.handles, embedder])
    embedder.backend.close()


async def test_an_embeddings_batch_returns_the_vectors_of_each_line(
    tiny_dir: Path, with_embedder: ModelManager, tmp_path: Path
) -> None:
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMBED, "input": [f"text {i}", "another"]},
        }
        for i in range(3)
    ]
    lines.append({**lines[0], "custom_id": "bad", "body": {"model": EMBED}})
    async with serving(tiny_dir, with_embedder, files_dir=str(tmp_path)) as (_, http):
        api = client(http)
        batch = await run_batch(api, jsonl(lines), endpoint="/v1/embeddings")
        outputs = await lines_of(api, batch.output_file_id)
        errors = await lines_of(api, batch.error_file_id)
        direct = await api.embeddings.create(model=EMBED, input=["text 0", "another"])
    assert batch.status == "completed" and batch.request_counts.completed == 3
    assert [e["custom_id"] for e in errors] == ["bad"]
    body = outputs[0]["response"]["body"]
    assert body["object"] == "list" and len(body["data"]) == 2
    assert body["data"][0]["embedding"] == pytest.approx(direct.data[0].embedding, abs=1e-5)


async def test_a_responses_batch_runs_through_the_responses_api(
    tiny_dir: Path, chat_models: ModelManager, tmp_path: Path
) -> None:
    line = {
        "custom_id": "r",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": MODEL, "input": "Hello", "max_output_tokens": 4},
    }
    async with serving(tiny_dir, chat_models, files_dir=str(tmp_path)) as (_, http):
        api = client(http)
        batch = await run_batch(api, jsonl([line]), endpoint="/v1/responses")
        outputs = await lines_of(api, batch.output_file_id)
    assert batch.status == "completed", batch.errors
    body = outputs[0]["response"]["body"]
    assert body["object"] == "response" and body["usage"]["output_tokens"] <= 4
