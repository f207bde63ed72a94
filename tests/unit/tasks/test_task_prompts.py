"""Entities, triples, keywords and captions: schemas follow the request; answers are cleaned."""

from __future__ import annotations

import pytest

from vlmserve.tasks import (
    DEFAULT_ENTITY_TYPES,
    entities_prompt,
    schema_errors,
    triples_prompt,
    triples_schema,
)
from vlmserve.tasks.captioning import caption_text
from vlmserve.tasks.keywords import keywords_schema, parse_keywords


def test_entity_types_restrict_the_enum_and_max_items_bounds_the_list() -> None:
    prompt = entities_prompt(["PERSON", "CITY"], max_items=2)
    props = prompt.schema["properties"]["entities"]
    assert props["items"]["properties"]["type"]["enum"] == ["PERSON", "CITY"]
    assert props["maxItems"] == 2
    assert "PERSON, CITY" in prompt.system
    assert prompt.max_tokens < entities_prompt().max_tokens


def test_default_entity_types_are_offered() -> None:
    enum = entities_prompt().schema["properties"]["entities"]["items"]["properties"]["type"]
    assert enum["enum"] == list(DEFAULT_ENTITY_TYPES)


def test_a_caller_schema_replaces_the_builtin_one_everywhere() -> None:
    mine = {"type": "object", "properties": {"people": {"type": "array"}}}
    prompt = triples_prompt(mine)
    assert prompt.schema is mine
    assert prompt.response_format()["json_schema"]["schema"] is mine
    assert '"people"' in prompt.system


def test_triples_schema_requires_all_three_parts() -> None:
    schema = triples_schema()
    good = {"triples": [{"subject": "Curie", "predicate": "born in", "object": "Warsaw"}]}
    assert schema_errors(good, schema) == []
    assert schema_errors({"triples": [{"subject": "Curie", "predicate": "born in"}]}, schema)


def test_keywords_schema_is_the_documented_one() -> None:
    assert keywords_schema(7) == {
        "type": "object",
        "properties": {
            "keywords": {
                "type": "array",
                "items": {"type": "string", "maxLength": 40},
                "maxItems": 7,
            }
        },
        "required": ["keywords"],
    }


def test_keywords_are_trimmed_lowercased_deduplicated_and_capped() -> None:
    text = '{"keywords": [" Beach ", "beach", "Sunset.", "", "dog", "sea"]}'
    assert parse_keywords(text, 3) == ["beach", "sunset", "dog"]


def test_a_cut_off_answer_keeps_its_complete_keywords() -> None:
    text = '{"keywords": ["beach", "sun\\"set", "do'
    assert parse_keywords(text, 10, truncated=True) == ["beach", 'sun"set']
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_keywords(text, 10)


@pytest.mark.parametrize("text", ["beach, sunset", '["beach"]', '{"tags": ["beach"]}'])
def test_an_answer_that_is_not_the_keywords_object_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_keywords(text, 10, truncated=True)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ('"A dog on a beach."', "A dog on a beach."),
        ("Caption: A dog.\nMore.", "A dog."),
        ("\n\n  A cat  \n", "A cat"),
    ],
)
def test_captions_are_one_clean_line(raw: str, expected: str) -> None:
    assert caption_text(raw) == expected
