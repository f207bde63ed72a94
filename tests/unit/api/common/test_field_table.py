"""The table of undeclared request fields (``api/common/fields.py``) and its docs/api.md listing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vlmserve.api.common.fields import (
    CHAT_FIELDS,
    MESSAGE_FIELDS,
    RESPONSES_FIELDS,
    FieldTable,
    check_messages,
)
from vlmserve.api.endpoints.chat.protocol import ChatCompletionRequest, ChatMessageIn
from vlmserve.api.endpoints.responses.protocol import ResponsesRequest
from vlmserve.errors import InvalidRequest, UnsupportedFeature

API_PAGE = Path(__file__).resolve().parents[4] / "docs" / "api.md"


def test_a_refused_field_is_a_400_only_when_it_asks_for_something() -> None:
    CHAT_FIELDS.check(
        {"skip_special_tokens": True, "min_p": 0.0, "guided_json": None}, strict=False
    )
    with pytest.raises(UnsupportedFeature) as caught:
        CHAT_FIELDS.check({"skip_special_tokens": False}, strict=False)
    assert caught.value.param == "skip_special_tokens"
    with pytest.raises(UnsupportedFeature):
        CHAT_FIELDS.check({"best_of": True}, strict=False)  # True == 1, but not the integer 1


def test_refusals_wait_for_a_model_served_here_and_unknown_names_are_returned() -> None:
    extra = {"guided_json": {}, "frobnicate": 1, "service_tier": "auto", "store": True}
    assert CHAT_FIELDS.check(extra, strict=False, refuse=False) == ["frobnicate"]
    with pytest.raises(InvalidRequest) as caught:
        CHAT_FIELDS.check(extra, strict=True, refuse=False)
    assert caught.value.param == "frobnicate" and caught.value.code == "unknown_field"


@pytest.mark.parametrize(
    ("table", "model", "title"),
    [
        (CHAT_FIELDS, ChatCompletionRequest, "`/v1/chat/completions` fields"),
        (RESPONSES_FIELDS, ResponsesRequest, "`/v1/responses` fields"),
        (MESSAGE_FIELDS, ChatMessageIn, "fields of a `messages[i]` object"),
    ],
)
def test_the_api_page_lists_every_field_with_its_status(
    table: FieldTable, model: type, title: str
) -> None:
    text = API_PAGE.read_text()
    section = text[text.index(title) :].split("\n\n", 1)[0]
    listed = set(re.findall(r"`([a-z_]+)`", section))
    assert not set(model.model_fields) - listed
    assert not set(table.no_ops) - listed
    assert not set(table.refusals) - listed
    assert not (set(model.model_fields) | set(table.no_ops)) & set(table.refusals)


def test_a_message_field_is_named_with_its_message() -> None:
    check_messages([{}, {"refusal": None, "annotations": []}], strict=True)  # the SDK's nulls
    with pytest.raises(UnsupportedFeature) as caught:
        check_messages([{}, {"audio": {"id": "a"}}], strict=False)
    assert caught.value.param == "messages[1].audio"
    with pytest.raises(InvalidRequest) as unknown:
        check_messages([{"colour": "red"}], strict=True)
    assert unknown.value.param == "messages[0].colour"
    check_messages([{"colour": "red"}], strict=False)  # logged, not refused
