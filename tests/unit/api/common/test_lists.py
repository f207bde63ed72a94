"""Too many messages are refused on their count alone, before any message is validated."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, ValidationError

from vlmserve.api.common.lists import MAX_MESSAGES, counted_first
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest
from vlmserve.api.endpoints.embeddings.protocol import EmbeddingsRequest
from vlmserve.api.endpoints.responses.protocol import ResponsesRequest
from vlmserve.api.endpoints.tokenize.protocol import TokenizeRequest
from vlmserve.api.endpoints.worker.protocol import GenerateRequestIn

MODELS = [ChatCompletionRequest, TokenizeRequest, EmbeddingsRequest, GenerateRequestIn]


def _counting_model(limit: int) -> tuple[type[BaseModel], list[str]]:
    seen: list[str] = []
    Item = Annotated[str, AfterValidator(lambda s: seen.append(s) or s)]

    class Model(BaseModel):
        items: Annotated[list[Item], counted_first(limit)] = Field(max_length=limit)

    return Model, seen


def test_a_list_over_its_limit_is_refused_before_any_item_is_validated() -> None:
    model, seen = _counting_model(10)
    with pytest.raises(ValidationError) as raised:
        model.model_validate({"items": ["x"] * 11})
    assert seen == []  # pydantic's max_length alone validates 11 items first
    error = raised.value.errors()[0]
    assert error["type"] == "too_long" and error["loc"] == ("items",)
    assert error["msg"] == "List should have at most 10 items after validation, not 11"
    assert model.model_validate({"items": ["x"] * 10}).items == ["x"] * 10  # type: ignore[attr-defined]
    assert len(seen) == 10


@pytest.mark.parametrize("model", MODELS)
def test_the_messages_are_counted_first(model: type[BaseModel]) -> None:
    metadata = model.model_fields["messages"].metadata
    assert any(isinstance(m, BeforeValidator) for m in metadata)
    bad = {"role": "nobody", "content": 7}
    with pytest.raises(ValidationError) as raised:
        model.model_validate({"model": "m", "messages": [bad] * (MAX_MESSAGES + 1)})
    errors = raised.value.errors()
    assert [(e["type"], e["loc"]) for e in errors] == [("too_long", ("messages",))]
    assert f"at most {MAX_MESSAGES} items" in errors[0]["msg"]


@pytest.mark.parametrize("model", MODELS)
def test_at_the_limit_the_messages_are_validated_as_before(model: type[BaseModel]) -> None:
    ok: dict[str, Any] = {"role": "user", "content": "hi"}
    request: Any = model.model_validate({"model": "m", "messages": [ok] * MAX_MESSAGES})
    assert len(request.messages) == MAX_MESSAGES
    bad = {"role": "nobody", "content": 7}
    with pytest.raises(ValidationError) as raised:
        model.model_validate({"model": "m", "messages": [ok] * (MAX_MESSAGES - 1) + [bad]})
    assert all(e["loc"][:2] == ("messages", MAX_MESSAGES - 1) for e in raised.value.errors())
    with pytest.raises(ValidationError):
        model.model_validate({"model": "m", "messages": []})  # at least one, as before


def test_tokenize_without_messages_still_takes_a_prompt() -> None:
    assert TokenizeRequest.model_validate({"model": "m", "prompt": "x"}).messages is None


def test_a_responses_input_list_is_counted_first_and_a_string_is_not_a_list() -> None:
    assert any(
        isinstance(m, BeforeValidator) for m in ResponsesRequest.model_fields["input"].metadata
    )
    with pytest.raises(ValidationError) as raised:
        ResponsesRequest.model_validate({"model": "m", "input": [7] * (MAX_MESSAGES + 1)})
    assert [e["type"] for e in raised.value.errors()] == ["too_long"]
    long_text = "x" * (MAX_MESSAGES + 1)
    assert ResponsesRequest.model_validate({"model": "m", "input": long_text}).input == long_text
