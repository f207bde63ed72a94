"""Knowledge-triple extraction (the GPU worker's triples over ``/generate``) as a schema task."""

from __future__ import annotations

from typing import Any

from vlmserve.tasks.base import TaskPrompt, schema_instruction

__all__ = ["MAX_TRIPLES", "triples_prompt", "triples_schema"]

MAX_TRIPLES = 32
MAX_ENTITY = 80  # characters per subject or object
MAX_PREDICATE = 40


def triples_schema(max_items: int = MAX_TRIPLES) -> dict[str, Any]:
    """``{"triples": [{"subject", "predicate", "object"}]}`` with bounded size."""
    entity = {"type": "string", "maxLength": MAX_ENTITY}
    predicate = {"type": "string", "maxLength": MAX_PREDICATE}
    triple = {
        "type": "object",
        "properties": {"subject": entity, "predicate": predicate, "object": entity},
        "required": ["subject", "predicate", "object"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"triples": {"type": "array", "items": triple, "maxItems": max_items}},
        "required": ["triples"],
        "additionalProperties": False,
    }


def triples_prompt(
    schema: dict[str, Any] | None = None, max_items: int = MAX_TRIPLES
) -> TaskPrompt:
    """The triple-extraction prompt; a caller's ``schema`` replaces the built-in one."""
    schema = schema or triples_schema(max_items)
    system = (
        "You extract knowledge-graph triples from the given text, images and video: facts "
        "of the form (subject, predicate, object), for example (Marie Curie, born in, "
        "Warsaw). Use short predicates in lower case, name entities fully, state only what "
        "the input shows or says. " + schema_instruction(schema)
    )
    return TaskPrompt(
        name="triples",
        system=system,
        instruction="Extract the (subject, predicate, object) triples.",
        schema=schema,
        max_tokens=min(8192, 64 + max_items * (2 * MAX_ENTITY + MAX_PREDICATE + 48)),
    )
