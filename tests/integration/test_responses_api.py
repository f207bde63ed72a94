"""/v1/responses with the official ``openai`` client, in-process on the tiny Qwen2-VL.

A random-weight model rarely stops by itself, so answers that must end with ``completed`` are
asked for with a small ``text.format`` JSON schema (the grammar engine ends them with "stop");
free text runs to ``max_output_tokens`` and ends ``incomplete``, as OpenAI's API says.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from support import MODEL
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.media import data_url, image_bytes

CAPTION = {
    "type": "object",
    "properties": {"caption": {"type": "string", "maxLength": 10}},
    "required": ["caption"],
    "additionalProperties": False,
}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "caption", "schema": CAPTION}}
OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
LONG = {"ignore_eos": True}  # free text that runs to max_output_tokens


class Verdict(BaseModel):
    ok: bool


def image_input(text: str = "Describe the image.") -> list[dict[str, Any]]:
    url = data_url(image_bytes(64, 64), "image/png")
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": text},
                {"type": "input_image", "image_url": url},
            ],
        }
    ]


async def openai_client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://vlmserve.test/v1", api_key="unused", http_client=http, max_retries=0
    )


@pytest.fixture
async def api(make_client: Callable[..., Any]) -> openai.AsyncOpenAI:
    return await openai_client(await make_client())


def tokens_generated(models: ModelManager) -> int:
    return models.resolve(MODEL).backend.tokens_generated  # type: ignore[no-any-return]


async def final(api: openai.AsyncOpenAI, response_id: str, timeout: float = 120) -> Any:
    """Poll ``retrieve`` until the response leaves queued / in_progress."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (response := await api.responses.retrieve(response_id)).status in (
        "queued",
        "in_progress",
    ):
        assert asyncio.get_running_loop().time() < deadline, "the response never finished"
        await asyncio.sleep(0.05)
    return response


async def test_image_input_answers_and_the_stream_ends_completed_with_the_same_text(
    api: openai.AsyncOpenAI,
) -> None:
    create = {
        "model": MODEL,
        "input": image_input(),
        "text": JSON_FORMAT,
        "temperature": 0,
        "max_output_tokens": 64,
    }
    response = await api.responses.create(**create)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.model == MODEL
    assert json.loads(response.output_text)["caption"] is not None  # the schema was enforced
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.input_tokens > 16  # the image's tokens are counted
    events = [event async for event in await api.responses.create(**create, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:4] == OPENING and kinds[-4:] == [*CLOSING, "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == response.output_text
    assert events[-4].text == text  # response.output_text.done


async def test_video_frames_and_string_content_are_taken_as_chat_takes_them(
    api: openai.AsyncOpenAI,
) -> None:
    frame = data_url(image_bytes(32, 32), "image/png")
    video = {"type": "input_video", "frames": [frame, frame]}
    text_only = await api.responses.create(model=MODEL, input="What happens?", max_output_tokens=2)
    with_video = await api.responses.create(
        model=MODEL,
        input=[
            {"role": "system", "content": "You watch clips."},
            {"role": "user", "content": [video, {"type": "input_text", "text": "What happens?"}]},
        ],
        max_output_tokens=2,
    )
    assert text_only.usage is not None and with_video.usage is not None
    assert with_video.usage.input_tokens > text_only.usage.input_tokens + 4


async def test_the_sdk_stream_helper_and_parse_read_our_events(api: openai.AsyncOpenAI) -> None:
    async with api.responses.stream(
        model=MODEL,
        input="Is it ok?",
        temperature=0,
        text_format=Verdict,
        max_output_tokens=64,
    ) as stream:
        streamed = await stream.get_final_response()
    parsed = await api.responses.parse(
        model=MODEL,
        input="Is it ok?",
        temperature=0,
        text_format=Verdict,
        max_output_tokens=64,
    )
    assert streamed.output_parsed == parsed.output_parsed
    assert isinstance(parsed.output_parsed, Verdict)


async def test_wire_has_event_lines_and_free_text_stops_incomplete(
    make_client: Callable[..., Any],
) -> None:
    http = await make_client()
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 6, "stream": True, **LONG}
    async with http.stream("POST", "/v1/responses", json=body) as r:
        raw = (await r.aread()).decode()
    messages = [m for m in raw.split("\n\n") if m]
    assert all(m.startswith("event: ") and "\ndata: " in m for m in messages)
    for message in messages:
        kind, data = message.removeprefix("event: ").split("\ndata: ", 1)
        assert json.loads(data)["type"] == kind
    last = json.loads(messages[-1].split("\ndata: ", 1)[1])
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 6
    assert "[DONE]" not in raw


@pytest.mark.parametrize("store", ["memory", "sqlite", "redis"])
async def test_background_response_finishes_like_a_foreground_one_and_replays_after_n(
    make_client: Callable[..., Any], tmp_path: Path, request: pytest.FixtureRequest, store: str
) -> None:
    settings: dict[str, Any] = {}
    if store == "sqlite":
        settings = {"persist_sessions": True, "sessions_db_path": str(tmp_path / "s.db")}
    elif store == "redis":
        settings = {"redis_url": request.getfixturevalue("redis_url")}
    api = await openai_client(await make_client(**settings))
    create = {
        "model": MODEL,
        "input": image_input("Tell a story."),
        "temperature": 0,
        "max_output_tokens": 24,
        "extra_body": LONG,
    }
    started = await api.responses.create(**create, background=True)
    assert started.status in ("queued", "in_progress") and started.background is True
    done = await final(api, started.id)
    foreground = await api.responses.create(**create)
    assert done.status == foreground.status == "incomplete"
    assert done.output_text == foreground.output_text != ""
    everything = [e async for e in await api.responses.retrieve(started.id, stream=True)]
    later = [
        e async for e in await api.responses.retrieve(started.id, stream=True, starting_after=5)
    ]
    assert [e.sequence_number for e in everything] == list(range(len(everything)))
    assert [e.model_dump() for e in later] == [e.model_dump() for e in everything[6:]]
    assert everything[-1].type == "response.incomplete"


async def test_no_listener_does_not_cancel_background_or_plain_responses(
    make_client: Callable[..., Any],
) -> None:
    api = await openai_client(await make_client(cancel_after_disconnect_seconds=0.1))
    create: dict[str, Any] = {
        "model": MODEL,
        "input": "Go on.",
        "max_output_tokens": 120,
        "extra_body": LONG,
    }
    background = await api.responses.create(**create, background=True)
    plain = await api.responses.create(**create)
    assert plain.status == "incomplete" and plain.usage and plain.usage.output_tokens == 120
    assert (await final(api, background.id)).status == "incomplete"


async def test_cancel_stops_a_background_response_within_a_step(
    api: openai.AsyncOpenAI, chat_models: ModelManager
) -> None:
    started = await api.responses.create(
        model=MODEL,
        input="Write a long story.",
        background=True,
        max_output_tokens=3000,
        extra_body=LONG,
    )
    while not (await api.responses.retrieve(started.id)).output_text:
        await asyncio.sleep(0.02)  # generating
    # past what it has produced so far: waits for those events; the cancel ends it first
    ahead = asyncio.ensure_future(
        api.responses.retrieve(started.id, stream=True, starting_after=10**6)
    )
    await asyncio.sleep(0.2)
    assert not ahead.done()
    cancelled = await api.responses.cancel(started.id)
    at_cancel = tokens_generated(chat_models)
    await asyncio.sleep(0.5)
    assert tokens_generated(chat_models) - at_cancel <= 1  # at most the step already running
    assert cancelled.status == "cancelled"
    again = await api.responses.retrieve(started.id)
    assert again.status == "cancelled" and again.output_text == cancelled.output_text
    assert [e async for e in await asyncio.wait_for(ahead, 30)] == []  # a 204: nothing follows
    assert (await api.responses.cancel(started.id)).status == "cancelled"  # idempotent
    events = [e async for e in await api.responses.retrieve(started.id, stream=True)]
    assert events[-1].type == "response.cancelled"


async def test_delete_removes_a_stored_response(api: openai.AsyncOpenAI) -> None:
    response = await api.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    await api.responses.delete(response.id)
    for call in (api.responses.retrieve, api.responses.delete, api.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            await call(response.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(response.id, stream=True)


async def test_store_false_answers_but_is_not_kept(api: openai.AsyncOpenAI) -> None:
    response = await api.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, store=False, temperature=0
    )
    stored = await api.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert response.output_text == stored.output_text
    # the second one finds the first's prompt in the prefix cache: only the cached count differs
    assert response.usage.model_dump(exclude={"input_tokens_details"}) == stored.usage.model_dump(
        exclude={"input_tokens_details"}
    )
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(response.id)


async def test_previous_response_id_puts_the_first_turn_in_the_second_prompt(
    api: openai.AsyncOpenAI,
) -> None:
    url = data_url(image_bytes(64, 64), "image/png")
    question = [
        {"type": "input_text", "text": "Name a colour."},
        {"type": "input_image", "image_url": url},
    ]
    sampling: dict[str, Any] = {"temperature": 0, "extra_body": LONG}
    first = await api.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": question}],
        instructions="Be brief.",
        max_output_tokens=6,
        **sampling,
    )
    second = await api.responses.create(
        model=MODEL,
        input="Why that one?",
        max_output_tokens=6,
        previous_response_id=first.id,
        **sampling,
    )
    assert second.previous_response_id == first.id and second.instructions is None
    # The same conversation as chat messages (instructions are not carried over, as in
    # OpenAI's API): the same prompt, so the same token count and the same greedy answer.
    messages: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Name a colour."},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        },
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Why that one?"},
    ]
    same = await api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, **sampling
    )
    assert second.usage is not None and same.usage is not None
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.output_text == same.choices[0].message.content


@pytest.mark.parametrize(
    ("create", "status", "param"),
    [
        ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            400,
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            404,
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            400,
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            400,
            "input[0].content[0]",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
            400,
            "input",
        ),
        ({"input": []}, 400, "input"),
        ({"tools": [{"type": "function", "name": "f"}]}, 400, "tools"),
        ({"background": True, "store": False}, 400, "store"),
        ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
        ({"model": "no-such-model"}, 404, None),
    ],
)
async def test_bad_requests_are_clear_4xx_in_openai_shape(
    make_client: Callable[..., Any], create: dict[str, Any], status: int, param: str | None
) -> None:
    http = await make_client()
    r = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **create})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


async def test_resume_past_the_end_and_unknown_ids(make_client: Callable[..., Any]) -> None:
    http = await make_client()
    done = (
        await http.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3}
        )
    ).json()
    last = (
        len(
            [
                e
                async for e in await (await openai_client(http)).responses.retrieve(
                    done["id"], stream=True
                )
            ]
        )
        - 1
    )
    past = await http.get(
        f"/v1/responses/{done['id']}", params={"stream": "true", "starting_after": last}
    )
    assert past.status_code == 204
    for path in ("/v1/responses/resp_nope", "/v1/responses/not-a-response-id"):
        assert (await http.get(path)).status_code == 404
    assert (await http.post("/v1/responses/resp_nope/cancel")).status_code == 404
    assert (await http.delete("/v1/responses/resp_nope")).status_code == 404
