"""Named-entity extraction (the GPU worker's NER over ``/generate``) as a task with a schema."""

from __future__ import annotations

from typing import Any

from vlmserve.tasks.base import TaskPrompt, schema_instruction

__all__ = ["DEFAULT_ENTITY_TYPES", "MAX_ENTITIES", "entities_prompt", "entities_schema"]

DEFAULT_ENTITY_TYPES = (
    "PERSON",
    "ORGANIZATION",
    "LOCATION",
    "DATE",
    "TIME",
    "EVENT",
    "PRODUCT",
    "MONEY",
    "OTHER",
)
MAX_ENTITIES = 32
MAX_TEXT = 100  # characters per entity mention


def entities_schema(
    types: tuple[str, ...] | list[str] = DEFAULT_ENTITY_TYPES, max_items: int = MAX_ENTITIES
) -> dict[str, Any]:
    """``{"entities": [{"text", "type"}]}``; ``type`` restricted to ``types``; bounded size."""
    entity = {
        "type": "object",
        "properties": {
            "text": {"type": "string", "maxLength": MAX_TEXT},
            "type": {"type": "string", "enum": list(types)},
        },
        "required": ["text", "type"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"entities": {"type": "array", "items": entity, "maxItems": max_items}},
        "required": ["entities"],
        "additionalProperties": False,
    }


def entities_prompt(
    types: tuple[str, ...] | list[str] = DEFAULT_ENTITY_TYPES,
    schema: dict[str, Any] | None = None,
    max_items: int = MAX_ENTITIES,
) -> TaskPrompt:
    """The NER prompt; a caller's ``schema`` replaces the built-in one (same instruction)."""
    schema = schema or entities_schema(types, max_items)
    system = (
        "You extract named entities from the given text, images and video. List every "
        "person, organization, place, date and other named thing that appears, each once, "
        f"with its type (one of: {', '.join(types)}). Copy entity text exactly as written "
        "or as it would be written; do not invent entities. " + schema_instruction(schema)
    )
    return TaskPrompt(
        name="entities",
        system=system,
        instruction="Extract the named entities.",
        schema=schema,
        max_tokens=min(4096, 64 + max_items * (MAX_TEXT + 24)),
    )
