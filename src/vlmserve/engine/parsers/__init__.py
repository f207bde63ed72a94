"""Output parsers of the chat API (pure Python, no torch): reasoning and tool calls.

REASONING_PARSERS[name].split(text, prompt=...) / .stream(prompt=...)   reasoning.py
detect_reasoning_parser(chat_template) -> "qwen3" | "deepseek_r1" | None
TOOL_PARSERS[name].parse(text) / .stream(incremental=False)             tool_calls.py
tool_call_schema(tools, tool_choice, parallel=...) -> JSON schema | None  tool_schema.py
"""

from __future__ import annotations

from vlmserve.engine.parsers.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
    detect_reasoning_parser,
)
from vlmserve.engine.parsers.tool_calls import (
    TOOL_PARSERS,
    HermesToolParser,
    ToolCall,
    ToolCallStream,
    ToolDelta,
)
from vlmserve.engine.parsers.tool_schema import (
    calls_from_enforced,
    tool_call_response_format,
    tool_call_schema,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "HermesToolParser",
    "ReasoningParser",
    "ReasoningStream",
    "ToolCall",
    "ToolCallStream",
    "ToolDelta",
    "calls_from_enforced",
    "detect_reasoning_parser",
    "tool_call_response_format",
    "tool_call_schema",
]
