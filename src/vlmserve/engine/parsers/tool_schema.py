"""The JSON schema that enforces ``tool_choice`` through the grammar engine.

``tool_choice: "required"`` must yield a call to one of ``tools``; a named choice
(``{"type": "function", "function": {"name": "f"}}``) a call to ``f``. Both are enforced by
constraining the output to the call object the ``hermes`` format carries::

    {"name": <const>, "arguments": <the function's parameters schema>}

``required`` is ``anyOf`` those objects (one per tool); with ``parallel=True`` it is a JSON
array of at least one of them (vLLM's shape for ``required``). ``"auto"`` and ``"none"``
need no grammar: ``tool_call_schema`` returns None for them.

The grammar produces the bare JSON, not the ``<tool_call>`` tags: read the output back with
``calls_from_enforced(text)``. ``tool_call_response_format`` wraps the schema as the
``response_format`` dict that ``GenerateRequest.response_format`` carries to the grammar.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vlmserve.engine.parsers.tool_calls import ToolCall, call_from_object
from vlmserve.errors import InvalidRequest

__all__ = [
    "calls_from_enforced",
    "function_schema",
    "tool_call_response_format",
    "tool_call_schema",
    "tool_names",
]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    """The function names of OpenAI ``tools`` entries, in order."""
    return [_function(tool, i)["name"] for i, tool in enumerate(tools)]


def function_schema(function: dict[str, Any]) -> dict[str, Any]:
    """``{"name": const, "arguments": parameters}`` for one OpenAI ``function`` object."""
    parameters = function.get("parameters") or _ANY_OBJECT
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_schema(
    tools: Sequence[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
    *,
    parallel: bool = False,
) -> dict[str, Any] | None:
    """The schema the grammar must enforce for ``choice``, or None if it needs none.

    Raises ``InvalidRequest`` (400) for a choice that names no tool or needs tools that were
    not given; the message says what to send instead.
    """
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidRequest(
            f"tool_choice {json.dumps(choice)} needs a non-empty 'tools' list; "
            "send tools or use tool_choice 'auto' or 'none'",
            param="tool_choice",
        )
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    if choice == "required":
        options = [function_schema(f) for f in functions]
        one = options[0] if len(options) == 1 else {"anyOf": options}
        return {"type": "array", "items": one, "minItems": 1} if parallel else one
    return function_schema(_named(functions, choice))


def tool_call_response_format(
    tools: Sequence[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
    *,
    parallel: bool = False,
) -> dict[str, Any] | None:
    """``tool_call_schema`` as the ``response_format`` the hf engine's grammar compiles."""
    schema = tool_call_schema(tools, choice, parallel=parallel)
    if schema is None:
        return None
    spec = {"name": "tool_call", "schema": schema, "strict": True}
    return {"type": "json_schema", "json_schema": spec}


def calls_from_enforced(text: str) -> list[ToolCall]:
    """The calls in a grammar-enforced output (one object or an array of them)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return []
    items = data if isinstance(data, list) else [data]
    calls = [call_from_object(item) for item in items]
    return [call for call in calls if call is not None]


def _named(functions: list[dict[str, Any]], choice: Any) -> dict[str, Any]:
    name = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise InvalidRequest(
            f"tool_choice {json.dumps(choice)} is not understood; use 'auto', 'none', "
            '\'required\' or {"type": "function", "function": {"name": "..."}}',
            param="tool_choice",
        )
    for function in functions:
        if function["name"] == name:
            return function
    known = ", ".join(f["name"] for f in functions)
    raise InvalidRequest(
        f"tool_choice names the function {name!r}, which is not in tools ({known})",
        param="tool_choice",
    )


def _function(tool: dict[str, Any], index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise InvalidRequest(
            f'tools[{index}] must be {{"type": "function", "function": '
            '{"name": "...", "parameters": {...}}}',
            param="tools",
        )
    return function
