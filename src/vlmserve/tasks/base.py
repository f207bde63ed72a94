"""What every task is: an instruction, a JSON schema, a token budget; and its one error."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vlmserve.errors import VlmserveError

__all__ = ["OutputInvalid", "TaskPrompt", "json_schema_format"]


class OutputInvalid(VlmserveError):
    """The model's answer does not parse or does not fit the schema (422, never a 500).

    Constrained decoding rules this out unless the answer was cut off (raise ``max_tokens``)
    or the model's server ignored ``response_format``.
    """

    status_code = 422
    error_type = "invalid_response_error"
    default_code = "invalid_model_output"


@dataclass(slots=True, frozen=True)
class TaskPrompt:
    name: str  # also the json_schema name sent to the engine
    system: str
    instruction: str  # goes after the media in the user turn
    schema: dict[str, Any]
    max_tokens: int  # default budget: enough for the schema's bounded answer

    def response_format(self) -> dict[str, Any]:
        return json_schema_format(self.name, self.schema)


def json_schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` for a strict JSON schema."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def schema_instruction(schema: dict[str, Any]) -> str:
    """The sentence that tells the model the exact JSON shape (helps unconstrained servers)."""
    return "Answer with one JSON object only, following this JSON schema:\n" + json.dumps(
        schema, separators=(",", ":")
    )
