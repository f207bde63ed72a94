"""A thinking model's reasoning as a Responses ``reasoning`` item, with the official ``openai``
client: JSON (stored or not), the event stream, and the next turn (which gets the answer only).

The checkpoint is scripted (``vlmserve.testing.scripted``): greedy decoding emits a chosen text
whatever the prompt, so what is tested is how the server splits and sends it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from support import make_settings
from vlmserve.api.app import build_app
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.scripted import THINKING_CHAT_TEMPLATE, build_scripted

THINKING = "The quick brown</think> The answer is 42."
THOUGHT, ANSWER = "The quick brown", " The answer is 42."
ASK: dict[str, Any] = {
    "model": "tiny",
    "input": "What is six times seven?",
    "temperature": 0,
    "max_output_tokens": 40,
}


@pytest.fixture(scope="module")
def thinking_models() -> Any:
    model_dir = build_scripted(THINKING, template=THINKING_CHAT_TEMPLATE)
    models = ModelManager.from_settings(make_settings(model_dir, served_model_name="tiny"))
    for handle in models.handles:
        handle.backend.load()
    yield model_dir, models
    models.close()


@pytest.fixture
async def api(thinking_models: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    model_dir, models = thinking_models
    app = build_app(make_settings(model_dir, served_model_name="tiny"), models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, timeout=60) as http:
            yield openai.AsyncOpenAI(
                base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
            )


def items(response: Any) -> list[tuple[str, str]]:
    """(type, text) of each output item."""
    found = []
    for item in response.output:
        parts = item.content or []
        found.append((item.type, "".join(getattr(p, "text", "") for p in parts)))
    return found


async def test_the_reasoning_is_its_own_item_before_the_answer(api: openai.AsyncOpenAI) -> None:
    for store in (True, False):
        response = await api.responses.create(**ASK, store=store)
        assert response.status == "completed"
        assert items(response) == [("reasoning", THOUGHT), ("message", ANSWER)], store
        assert response.output_text == ANSWER
        assert response.output[0].id.startswith("rs_")
        if store:
            stored = await api.responses.retrieve(response.id)
            assert items(stored) == [("reasoning", THOUGHT), ("message", ANSWER)]


async def test_the_stream_sends_reasoning_events_then_the_message_at_output_1(
    api: openai.AsyncOpenAI,
) -> None:
    events = [e async for e in await api.responses.create(**ASK, stream=True)]
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    thinking = kinds[3 : kinds.index("response.reasoning_text.done")]
    assert set(thinking) == {"response.reasoning_text.delta"}
    assert kinds[3 + len(thinking) : first_text] == [
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.completed"
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (THOUGHT, ANSWER)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    assert items(events[-1].response) == [("reasoning", THOUGHT), ("message", ANSWER)]
    async with api.responses.stream(**ASK) as stream:  # the SDK's own accumulator
        final = await stream.get_final_response()
    assert final.output_text == ANSWER


async def test_cut_off_while_thinking_gives_only_a_reasoning_item(
    api: openai.AsyncOpenAI,
) -> None:
    response = await api.responses.create(**{**ASK, "max_output_tokens": 2})
    assert response.status == "incomplete"
    assert [kind for kind, _ in items(response)] == ["reasoning"]
    assert response.output_text == ""


async def test_the_next_turn_gets_the_answer_without_the_reasoning(
    api: openai.AsyncOpenAI,
) -> None:
    first = await api.responses.create(**ASK)
    second = await api.responses.create(**{**ASK, "input": "And?"}, previous_response_id=first.id)
    page = await api.responses.input_items.list(second.id, order="asc")
    assert [item.role for item in page.data] == ["user", "assistant", "user"]  # type: ignore[union-attr]
    said = page.data[1].model_dump()["content"][0]["text"]
    assert said == ANSWER and THOUGHT not in said
