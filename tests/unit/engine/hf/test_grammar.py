"""response_format -> xgrammar grammar -> token masks, on the tiny Qwen2-VL tokenizer (V=1038)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from vlmserve.engine.hf.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    allocate_masks,
    apply_masks,
)
from vlmserve.errors import InvalidRequest, UnsupportedFeature

V = 1038  # tiny Qwen2-VL: config vocab_size == len(tokenizer)
IM_END = 1026  # tokenizer eos: the grammar's stop token
SPECIAL = range(1024, 1038)  # <|endoftext|>, <|im_start|>, <|im_end|>, vision tokens, ...

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


def json_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size=V)


def allowed(matcher: Any) -> list[int]:
    masks = allocate_masks(1, V)
    matcher.fill_mask(masks, 0)
    logits = torch.zeros(1, V)
    apply_masks(logits, masks)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def random_walk(grammar: CompiledGrammar, seed: int, limit: int = 300) -> list[int]:
    """Uniformly random allowed tokens until the grammar ends: the worst case of a bad model."""
    rnd, matcher, ids = random.Random(seed), grammar.matcher(), []
    while not matcher.is_terminated() and len(ids) < limit:
        token = rnd.choice(allowed(matcher))
        matcher.accept(token)
        ids.append(token)
    return ids


def test_random_token_walks_always_give_schema_valid_json(compiler: Any, tokenizer: Any) -> None:
    grammar = compiler.compile(json_schema(PERSON))
    for seed in range(150):
        ids = random_walk(grammar, seed)
        assert ids[-1] == IM_END, f"seed {seed} did not finish"
        text = tokenizer.decode(ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), PERSON)


def test_control_tokens_are_never_allowed_and_only_the_stop_token_ends(compiler: Any) -> None:
    grammar = compiler.compile(json_schema({"type": "object", "properties": {"s": PERSON}}))
    matcher = grammar.matcher()
    matcher.accept(298)  # '{"'
    assert not set(allowed(matcher)) & set(SPECIAL)  # <|endoftext|> is a model eos too
    complete = compiler.compile(json_schema({"const": {"a": 1}})).matcher()
    for token in (90, 1, 64, 1, 25, 16, 92):  # {"a":1}
        complete.accept(token)
    assert allowed(complete) == [IM_END]
    complete.accept(IM_END)
    assert complete.is_terminated()


@pytest.mark.parametrize(
    "raw",
    [b"a\tb", b"\x01", b"\xed\xa0\x80", b"\xe0\x8e\xab"],
    ids=["tab", "control", "utf8-surrogate", "overlong-utf8"],
)
@pytest.mark.parametrize("schema", [{"maxLength": 8}, {}, {"pattern": "^.{0,8}$"}])
def test_strings_reject_bytes_that_are_not_valid_json_text(
    compiler: Any, raw: bytes, schema: dict
) -> None:
    grammar = compiler.compile(json_schema({"type": "string", **schema}))
    matcher = grammar.matcher()._matcher  # byte-level check, below the token level
    assert not matcher.accept_string(b'"' + raw + b'"')
    assert grammar.matcher()._matcher.accept_string('"é😀x"'.encode())


def test_prefix_resume_continues_the_grammar_state(compiler: Any, tokenizer: Any) -> None:
    grammar = compiler.compile(json_schema(PERSON))
    ids = random_walk(grammar, seed=7)
    cut = len(ids) // 2
    resumed = grammar.matcher(ids[:cut])
    assert allowed(resumed) != allowed(grammar.matcher())
    for token in ids[cut:]:
        resumed.accept(token)
    assert resumed.is_terminated()
    fresh = grammar.matcher()
    with pytest.raises(RuntimeError, match="not allowed"):
        fresh.accept(ids[cut])  # the continuation is only valid after the prefix
    with pytest.raises(InvalidRequest):
        grammar.matcher(ids[cut:])


def test_json_object_is_an_object_not_any_value(compiler: Any, tokenizer: Any) -> None:
    grammar = compiler.compile({"type": "json_object"})
    matcher = grammar.matcher()
    with pytest.raises(RuntimeError):
        matcher.accept(tokenizer.encode("[", add_special_tokens=False)[0])
    with pytest.raises(RuntimeError):
        grammar.matcher().accept(tokenizer.encode(" ", add_special_tokens=False)[0])
    for seed in range(20):
        text = tokenizer.decode(random_walk(grammar, seed, limit=2000), skip_special_tokens=True)
        assert isinstance(json.loads(text), dict)


def test_compiled_grammars_are_cached_by_schema_text(compiler: Any) -> None:
    a = compiler.compile(json_schema(PERSON))
    assert compiler.compile(json_schema(json.loads(json.dumps(PERSON)))) is a
    reordered = {**PERSON, "properties": dict(reversed(PERSON["properties"].items()))}
    assert compiler.compile(json_schema(reordered)) is not a  # order = output order


def test_apply_masks_touches_only_the_given_rows() -> None:
    masks = allocate_masks(3, V)
    assert masks.shape == (3, 33) and masks.dtype == torch.int32  # ceil(1038 / 32)
    masks[:] = 0
    masks[:, 0] = 1  # only token 0 allowed
    logits = torch.zeros(3, V)
    apply_masks(logits, masks, rows=[1])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0]


UNSUPPORTED = [
    ({"type": "object", "properties": {"x": {"not": {"type": "null"}}}}, "'not'", "$.properties.x"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'", "$"),
    ({"type": "array", "contains": {"const": 1}}, "'contains'", "$"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "'propertyNames'", "$"),
    ({"type": "object", "if": {}, "then": {}}, "'if'", "$"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'", "$"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'", "$"),
    ({"type": "string", "format": "iri"}, "'iri'", "$"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'pattern'", "$"),
    ({"type": "string", "pattern": "^(?=.*1).{2}$"}, "lookahead", "$.pattern"),
    ({"type": "string", "pattern": "a^b"}, "anchor", "$.pattern"),
    ({"maxLength": 3}, "'maxLength'", "$"),
    ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "'allOf'", "$"),
    ({"anyOf": [{"type": "string"}], "type": "integer"}, "'type'", "$"),
    ({"$ref": "#/$defs/a", "maxLength": 2, "$defs": {"a": {"type": "string"}}}, "'maxLength'", "$"),
    ({"$ref": "https://example.com/s.json"}, "$ref", "$"),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf", "$"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "'b'", "$"),
    (
        {
            "type": "object",
            "properties": {"xa": {"type": "string"}},
            "patternProperties": {"^x": {"type": "integer"}},
        },
        "patternProperties",
        "$",
    ),
    ({"type": "string", "pattern": "\\p{L}+"}, "not supported", ""),
]


@pytest.mark.parametrize(("schema", "named", "where"), UNSUPPORTED)
def test_unenforceable_schema_features_are_refused_naming_them(
    compiler: Any, schema: Any, named: str, where: str
) -> None:
    with pytest.raises(UnsupportedFeature) as info:
        compiler.compile(json_schema(schema))
    assert info.value.param == "response_format" and info.value.status_code == 400
    assert named in info.value.message
    assert f"at {where}" in info.value.message or not where


ENFORCED = [
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    {
        "oneOf": [
            {"$ref": "#/$defs/cat"},
            {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]},
        ],
        "$defs": {
            "cat": {
                "type": "object",
                "properties": {"kind": {"const": "cat"}},
                "required": ["kind"],
            }
        },
    },
    {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"}], "default": None},
    {"type": "array", "prefixItems": [{"type": "integer", "multipleOf": 3}], "items": False},
    {"type": "string", "pattern": "^[a-z]{2,4}$", "description": "code"},
    {"type": "object", "properties": {"n": {"$ref": "#"}}},
]


@pytest.mark.parametrize("schema", ENFORCED)
def test_enforceable_schemas_compile_and_walks_validate(
    compiler: Any, tokenizer: Any, schema: Any
) -> None:
    grammar = compiler.compile(json_schema(schema))
    for seed in range(10):
        ids = random_walk(grammar, seed, limit=400)
        if ids[-1] == IM_END:  # recursive schemas may run past the limit
            jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), schema)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}},
        json_schema({"type": "strnig"}),
        json_schema({"enum": []}),
        json_schema({"$ref": "#/$defs/missing"}),
        json_schema({"type": "string", "minLength": 5, "maxLength": 2}),
        json_schema({"type": "array", "items": [{"type": "integer"}]}),
        json_schema({"type": "integer", "minimum": "3"}),
        {"type": "xml"},
    ],
)
def test_malformed_response_formats_are_invalid_requests(
    compiler: Any, response_format: dict
) -> None:
    with pytest.raises(InvalidRequest) as info:
        compiler.compile(response_format)
    assert info.value.param == "response_format" and info.value.status_code == 400
