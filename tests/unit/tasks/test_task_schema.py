"""The schema checker catches what an unconstrained or cut-off answer gets wrong."""

from __future__ import annotations

import pytest

from vlmserve.tasks import check_schema, entities_schema, parse_json, schema_errors

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "kind": {"enum": ["a", "b"]},
        "age": {"type": "integer", "minimum": 0},
        "note": {"type": ["string", "null"]},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


def test_a_fitting_answer_has_no_errors() -> None:
    value = {"name": "ann", "tags": ["x"], "kind": "a", "age": 3, "note": None}
    assert schema_errors(value, SCHEMA) == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"tags": []}, "$: missing required key 'name'"),
        ({"name": "toolong", "tags": []}, "$.name: longer than 5 characters"),
        ({"name": "a", "tags": ["1", "2", "3"]}, "$.tags: more than 2 items"),
        ({"name": "a", "tags": [1]}, "$.tags[0]: expected string, got int"),
        ({"name": "a", "tags": [], "kind": "c"}, "$.kind: 'c' is not one of ['a', 'b']"),
        ({"name": "a", "tags": [], "age": -1}, "$.age: -1 is below the minimum 0"),
        ({"name": "a", "tags": [], "age": True}, "$.age: expected integer, got bool"),
        ({"name": "a", "tags": [], "x": 1}, "$: unexpected key 'x'"),
        ([], "$: expected object, got list"),
    ],
)
def test_each_violation_is_named_with_its_path(value: object, expected: str) -> None:
    assert expected in schema_errors(value, SCHEMA)


def test_any_of_and_local_refs_are_followed() -> None:
    schema = {
        "$defs": {"n": {"type": "integer"}},
        "type": "object",
        "properties": {"v": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
    }
    assert schema_errors({"v": 3}, schema) == []
    assert schema_errors({"v": None}, schema) == []
    assert schema_errors({"v": "x"}, schema) == ["$.v: matches none of the anyOf alternatives"]


def test_the_builtin_entities_schema_rejects_an_unknown_type() -> None:
    schema = entities_schema(["PERSON"])
    assert schema_errors({"entities": [{"text": "Ann", "type": "PERSON"}]}, schema) == []
    assert schema_errors({"entities": [{"text": "Ann", "type": "PLACE"}]}, schema)


def test_parse_json_accepts_a_fenced_answer_and_names_the_problem_otherwise() -> None:
    assert parse_json('```json\n{"a": 1}\n```') == {"a": 1}
    assert parse_json('  {"a": [1, 2]} ') == {"a": [1, 2]}
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_json('{"a": [1, 2')


HUGE = {"type": "object", "description": "y" * 70_000}


@pytest.mark.parametrize("schema", [[], "x", {"type": "array"}, HUGE])
def test_a_caller_schema_must_be_a_small_object_schema(schema: object) -> None:
    with pytest.raises(ValueError, match="schema"):
        check_schema(schema)


def test_a_caller_object_schema_is_accepted_as_is() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert check_schema(schema) is schema


@pytest.mark.parametrize("answer", ['{"n": 2e999}', "-1e400", "[NaN]", '{"x": Infinity}'])
def test_an_answer_with_a_number_no_float_can_hold_is_refused_not_a_500(answer: str) -> None:
    with pytest.raises(ValueError, match="out of range"):
        parse_json(answer)
