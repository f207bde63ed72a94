"""Stored responses as state a user keeps: whose they are (API keys), how long they are kept,
their input items, and images that come from uploaded files. The official ``openai`` client,
in-process on the tiny Qwen2-VL."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from support import MODEL
from vlmserve.testing.media import data_url, image_bytes

GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 4}
PNG = image_bytes(48, 48)


def client(http: httpx.AsyncClient, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://vlmserve.test/v1", api_key=key, http_client=http, max_retries=0
    )


def ask(image: dict[str, Any], text: str = "What is this?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": text}, {"type": "input_image", **image}],
        }
    ]


async def test_another_keys_response_is_a_404_for_every_call(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    http = await make_client(api_keys=["k1", "k2"], files_dir=str(tmp_path))
    one, two = client(http, "k1"), client(http, "k2")
    made = await one.responses.create(model=MODEL, input="Hi", **GREEDY)
    with pytest.raises(openai.NotFoundError):
        await two.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await two.responses.retrieve(made.id, stream=True)
    with pytest.raises(openai.NotFoundError):
        await two.responses.cancel(made.id)
    with pytest.raises(openai.NotFoundError):
        await two.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await two.responses.input_items.list(made.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await two.responses.create(
            model=MODEL, input="And?", previous_response_id=made.id, **GREEDY
        )
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    # the owner still has it all: nothing above touched it
    assert (await one.responses.retrieve(made.id)).output_text == made.output_text
    follow = await one.responses.create(
        model=MODEL, input="And?", previous_response_id=made.id, **GREEDY
    )
    assert follow.status in ("completed", "incomplete")


async def test_a_response_is_a_404_once_its_retention_has_passed(
    make_client: Callable[..., Any],
) -> None:
    api = client(await make_client(sessions_ttl_seconds=1))
    made = await api.responses.create(model=MODEL, input="Hi", **GREEDY)
    assert (await api.responses.retrieve(made.id)).id == made.id
    await asyncio.sleep(1.6)
    with pytest.raises(openai.NotFoundError, match="VLMSERVE_SESSIONS_TTL_SECONDS"):
        await api.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.create(
            model=MODEL, input="And?", previous_response_id=made.id, **GREEDY
        )


async def test_an_uploaded_image_answers_as_the_same_image_sent_as_a_data_url(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    api = client(await make_client(files_dir=str(tmp_path)))
    upload = await api.files.create(file=("photo.png", PNG), purpose="vision")
    by_file = await api.responses.create(model=MODEL, input=ask({"file_id": upload.id}), **GREEDY)
    by_url = await api.responses.create(
        model=MODEL, input=ask({"image_url": data_url(PNG, "image/png")}), **GREEDY
    )
    assert by_file.usage is not None and by_url.usage is not None
    assert by_file.usage.input_tokens == by_url.usage.input_tokens > 16  # the image's tokens
    assert by_file.output_text == by_url.output_text
    streamed = [
        e
        async for e in await api.responses.create(
            model=MODEL, input=ask({"file_id": upload.id}), stream=True, **GREEDY
        )
    ]
    assert streamed[-1].response.output_text == by_file.output_text  # type: ignore[union-attr]


async def test_file_images_are_the_callers_own_of_an_image_purpose(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    http = await make_client(api_keys=["k1", "k2"], files_dir=str(tmp_path))
    one, two = client(http, "k1"), client(http, "k2")
    mine = await one.files.create(file=("p.png", PNG), purpose="user_data")
    assert (
        await one.responses.create(model=MODEL, input=ask({"file_id": mine.id}), **GREEDY)
    ).usage is not None
    with pytest.raises(openai.NotFoundError) as caught:
        await two.responses.create(model=MODEL, input=ask({"file_id": mine.id}), **GREEDY)
    assert caught.value.body["param"] == "input[0].content[1]"  # type: ignore[index]
    batch_file = await one.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        await one.responses.create(model=MODEL, input=ask({"file_id": batch_file.id}), **GREEDY)
    text = await one.files.create(file=("notes.txt", b"just words"), purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="is not an image"):
        await one.responses.create(model=MODEL, input=ask({"file_id": text.id}), **GREEDY)


async def test_input_items_list_the_conversation_newest_first_with_file_ids(
    make_client: Callable[..., Any], tmp_path: Path
) -> None:
    api = client(await make_client(files_dir=str(tmp_path)))
    upload = await api.files.create(file=("photo.png", PNG), purpose="vision")
    first = await api.responses.create(
        model=MODEL, input=ask({"file_id": upload.id}), instructions="Be brief.", **GREEDY
    )
    second = await api.responses.create(
        model=MODEL, input="Why?", previous_response_id=first.id, **GREEDY
    )
    page = await api.responses.input_items.list(
        second.id, include=["message.input_image.image_url"]
    )
    items = [item.model_dump() for item in page.data]
    # newest first: this turn's question, the first answer, the first question (instructions
    # are not items, and are not carried over)
    assert [i["role"] for i in items] == ["user", "assistant", "user"]
    assert [(c["type"], c["text"]) for c in items[0]["content"]] == [("input_text", "Why?")]
    assert items[1]["content"][0]["text"] == first.output_text
    image = items[2]["content"][1]
    assert image["type"] == "input_image" and image["file_id"] == upload.id
    assert image["image_url"] is None  # not the data URL it was read into
    assert len({i["id"] for i in items}) == 3 and not page.has_more
    oldest = await api.responses.input_items.list(second.id, order="asc", limit=1)
    assert [i.id for i in oldest.data] == [items[2]["id"]] and oldest.has_more
    rest = await api.responses.input_items.list(second.id, order="asc", after=oldest.data[0].id)
    assert [i.id for i in rest.data] == [items[1]["id"], items[0]["id"]]
    only = await api.responses.input_items.list(first.id)
    assert [i.model_dump()["content"][1]["file_id"] for i in only.data] == [upload.id]


async def test_the_new_routes_are_in_the_openapi_document(make_client: Callable[..., Any]) -> None:
    spec = (await (await make_client()).get("/openapi.json")).json()
    paths = spec["paths"]
    assert "get" in paths["/v1/responses/{response_id}/input_items"]
    for path, method in (
        ("/v1/responses", "post"),
        ("/v1/responses/{response_id}", "delete"),
        ("/v1/responses/{response_id}/cancel", "post"),
        ("/v1/files", "post"),
        ("/v1/files/{file_id}/content", "get"),
        ("/v1/batches", "post"),
        ("/v1/batches/{batch_id}/cancel", "post"),
    ):
        assert method in paths[path], path


async def test_the_key_blind_stream_routes_do_not_open_a_response(
    make_client: Callable[..., Any],
) -> None:
    http = await make_client(api_keys=["k1", "k2"])
    made = await client(http, "k1").responses.create(model=MODEL, input="Hi", **GREEDY)
    own, other = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    for call in (
        http.get(f"/v1/streams/{made.id}", headers=own),
        http.post(f"/v1/cancel/{made.id}", headers=own),
    ):
        r = await call
        assert r.status_code == 404 and "GET /v1/responses/" in r.json()["error"]["message"]
    unknown = "resp_" + "0" * 32
    for path in ("/v1/streams/{}", "/v1/cancel/{}"):
        method = http.get if path.startswith("/v1/streams") else http.post
        theirs = await method(path.format(made.id), headers=other)
        nobodys = await method(path.format(unknown), headers=other)
        assert theirs.status_code == nobodys.status_code == 404  # another key's: as unknown
        assert theirs.text.replace(made.id, unknown) == nobodys.text
