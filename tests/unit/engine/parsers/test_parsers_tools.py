"""The hermes tool-call parser and the tool_choice schema: one shot, streamed, never raising."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmserve.engine.parsers import (
    TOOL_PARSERS,
    calls_from_enforced,
    tool_call_response_format,
    tool_call_schema,
)
from vlmserve.engine.parsers.tool_calls import ToolCall
from vlmserve.errors import InvalidRequest

HERMES = TOOL_PARSERS["hermes"]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'


def cuts(text: str, points: list[int]) -> list[str]:
    marks = sorted({p % (len(text) + 1) for p in points})
    return [text[a:b] for a, b in itertools.pairwise([0, *marks, len(text)])]


def streamed(deltas: list[str]) -> tuple[str, list[dict[str, Any]]]:
    stream = HERMES.stream()
    outs = [stream.feed(d) for d in deltas]
    outs.append(stream.finish())
    return "".join(o.content for o in outs), [c for o in outs for c in o.tool_calls]


def assemble(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """What an OpenAI client builds from tool_calls deltas: (name, arguments) per index."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
        call["name"] += delta["function"].get("name", "")
        call["arguments"] += delta["function"].get("arguments", "")
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def named(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def test_parses_a_call_and_keeps_the_text_around_it() -> None:
    content, calls = HERMES.parse(f"Let me check.\n{WEATHER}\nDone.")
    assert content == "Let me check.\n\nDone."
    assert named(calls) == [("get_weather", '{"city": "Paris"}')]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", calls[0].id)
    assert calls[0].to_openai()["function"]["name"] == "get_weather"


def test_parallel_calls_keep_their_order() -> None:
    content, calls = HERMES.parse(f"{WEATHER}\n{TIME}")
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert content == "\n"
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # missing brace
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n["f", {}]\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": 3}\n</tool_call>',
        "<tool_call>" + "[" * 100000 + "</tool_call>",  # deeper than Python's stack
    ],
)
def test_malformed_blocks_stay_content(block: str) -> None:
    assert HERMES.parse(f"a{block}b") == (f"a{block}b", [])
    assert streamed([f"a{block}b"]) == (f"a{block}b", [])


def test_unclosed_block_at_the_end_is_a_call_when_complete() -> None:
    _, calls = HERMES.parse(WEATHER.removesuffix("</tool_call>"))
    assert named(calls) == [("get_weather", '{"city": "Paris"}')]
    assert HERMES.parse('x<tool_call>\n{"name": ') == ('x<tool_call>\n{"name": ', [])


def test_arguments_as_a_json_string_and_parameters_alias() -> None:
    _, calls = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert named(calls) == [("f", '{"a": 1}')]
    _, calls = HERMES.parse('<tool_call>{"name": "f", "parameters": {"é": 1}}</tool_call>')
    assert named(calls) == [("f", '{"é": 1}')]
    _, calls = HERMES.parse('<tool_call>{"name": "f"}</tool_call>')
    assert named(calls) == [("f", "{}")]


def test_stream_deltas_have_the_openai_shape() -> None:
    stream = HERMES.stream()
    assert stream.feed("Sure. <tool").content == "Sure. "
    assert not stream.feed('_call>\n{"name": "get_weather", "arguments": {"ci')
    out = stream.feed('ty": "Paris"}}\n</tool_call>')
    first, second = out.tool_calls
    assert first == {
        "index": 0,
        "id": stream.calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert second == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    out = stream.feed(TIME)
    assert [d["index"] for d in out.tool_calls] == [1, 1]
    assert not stream.finish()


TEXTS = [
    f"Let me check.\n{WEATHER}\n{TIME}\nDone.",
    f"<tool_call>broken</tool_call>{WEATHER}",
    f"x <tool_cal y {WEATHER.removesuffix('</tool_call>')}",
    '<tool_call><tool_call>{"name": "a"}</tool_call></tool_call>',
    "",
]


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.sampled_from(TEXTS),
        st.lists(
            st.sampled_from(
                ["<tool_call>", "</tool_call>", '{"name": "f"}', "{", "<", "tool", " ", "x"]
            ),
            max_size=10,
        ).map("".join),
    ),
    points=st.lists(st.integers(min_value=0, max_value=200), max_size=15),
)
def test_every_split_into_deltas_streams_the_one_shot_result(text: str, points: list[int]) -> None:
    content, calls = HERMES.parse(text)
    got_content, deltas = streamed(cuts(text, points))
    assert got_content == content
    assert assemble(deltas) == named(calls)
    for delta in deltas:
        if "id" in delta:
            assert delta["type"] == "function" and delta["function"]["arguments"] == ""


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def test_schema_for_a_named_function_fixes_the_name_and_its_parameters() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    schema = tool_call_schema(TOOLS, choice)
    assert schema is not None
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == TOOLS[0]["function"]["parameters"]
    assert schema["required"] == ["name", "arguments"]


def test_schema_for_required_is_any_of_the_tools() -> None:
    schema = tool_call_schema(TOOLS, "required")
    assert schema is not None
    names = [branch["properties"]["name"]["const"] for branch in schema["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    parallel = tool_call_schema(TOOLS, "required", parallel=True)
    assert parallel == {"type": "array", "items": schema, "minItems": 1}


def test_auto_and_none_need_no_schema() -> None:
    assert tool_call_schema(TOOLS, "auto") is None
    assert tool_call_schema(TOOLS, "none") is None
    assert tool_call_schema(None, None) is None


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        (None, "required", "non-empty 'tools'"),
        (TOOLS, "sometimes", "not understood"),
        ([{"type": "function"}], "required", r"tools\[0\]"),
    ],
)
def test_bad_choices_are_400s_that_say_what_to_send(tools: Any, choice: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        tool_call_schema(tools, choice)


def test_enforced_output_reads_back_as_calls() -> None:
    one = calls_from_enforced('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert named(one) == [("get_weather", '{"city": "Paris"}')]
    many = calls_from_enforced(json.dumps([{"name": "a", "arguments": {}}, {"name": "b"}]))
    assert [c.name for c in many] == ["a", "b"]
    assert calls_from_enforced("{not json") == []


@pytest.fixture(scope="module")
def grammar() -> Any:
    from vlmserve.engine.hf.grammar import GrammarCompiler
    from vlmserve.testing.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer(1024)
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer))


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        ("required", False),
        ("required", True),
        ({"type": "function", "function": {"name": "get_time"}}, False),
    ],
)
def test_the_response_format_compiles_in_the_grammar_engine(
    grammar: Any, choice: Any, parallel: bool
) -> None:
    response_format = tool_call_response_format(TOOLS, choice, parallel=parallel)
    assert response_format is not None
    grammar.compile(response_format)


def incremental(deltas: list[str]) -> tuple[str, list[dict[str, Any]]]:
    stream = HERMES.stream(incremental=True)
    outs = [stream.feed(d) for d in deltas]
    outs.append(stream.finish())
    return "".join(o.content for o in outs), [c for o in outs for c in o.tool_calls]


def test_incremental_stream_sends_the_name_before_the_arguments_end() -> None:
    stream = HERMES.stream(incremental=True)
    out = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert out.tool_calls == [
        {
            "index": 0,
            "id": stream.calls[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"ci'}},
    ]
    out = stream.feed('ty": "Paris"}}\n</tool_call> ok')
    assert out.tool_calls == [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]
    assert out.content == " ok"


def test_incremental_call_cut_short_keeps_what_was_sent() -> None:
    content, deltas = incremental(['<tool_call>{"name": "f", "arguments": {"a": tru</tool_call>x'])
    assert assemble(deltas) == [("f", '{"a": tru')]
    assert content == "x"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
WELL_FORMED = st.lists(
    st.one_of(
        st.text(alphabet=st.sampled_from(list("ab <>/\n")), max_size=8).filter(
            lambda t: "<tool_call>" not in t
        ),
        st.tuples(
            st.text(alphabet=st.sampled_from(list("abc_")), min_size=1, max_size=6),
            st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3),
        ).map(
            lambda c: (
                "<tool_call>\n"
                + json.dumps({"name": c[0], "arguments": c[1]}, ensure_ascii=False)
                + "\n</tool_call>"
            )
        ),
    ),
    max_size=4,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=WELL_FORMED, points=st.lists(st.integers(min_value=0, max_value=400), max_size=15))
def test_incremental_stream_agrees_with_parse_on_well_formed_calls(
    text: str, points: list[int]
) -> None:
    content, calls = HERMES.parse(text)
    got_content, deltas = incremental(cuts(text, points))
    assert got_content == content
    got = [(name, json.loads(arguments)) for name, arguments in assemble(deltas)]
    assert got == [(c.name, json.loads(c.arguments)) for c in calls]


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(
            ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', "{", "}", '"', "<", "x"]
        ),
        max_size=12,
    ).map("".join),
    points=st.lists(st.integers(min_value=0, max_value=200), max_size=15),
)
def test_incremental_stream_never_raises_and_every_delta_belongs_to_a_sent_call(
    text: str, points: list[int]
) -> None:
    _, deltas = incremental(cuts(text, points))
    opened: set[int] = set()
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] == len(opened)
            opened.add(delta["index"])
        assert delta["index"] in opened
