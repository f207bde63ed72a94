"""Task prompts and JSON schemas: NER, triples, ID-card (KTP) OCR, captions and keywords.

Pure Python (no torch, no fastapi): the API's task endpoints and the ``vlmserve tag`` client
both use it. Each structured task is a ``TaskPrompt`` (system prompt, instruction, schema,
token budget) whose answer is asked for with ``response_format`` json_schema and checked
with ``schema_errors`` afterwards.

    name        endpoint                                  builder
    entities    POST /v1/extract/entities                 entities_prompt(types, schema)
    triples     POST /v1/extract/triples                  triples_prompt(schema)
    id_card     POST /v1/extract/id-card, POST /ktp-ocr/  id_card_prompt(schema) + validate_id_card
    caption     vlmserve tag                              CAPTION_PROMPT
    keywords    vlmserve tag                              keywords_prompt + parse_keywords
    description vlmserve tag                              DESCRIPTION_PROMPT
"""

from __future__ import annotations

from vlmserve.tasks.base import OutputInvalid, TaskPrompt, json_schema_format
from vlmserve.tasks.entities import (
    DEFAULT_ENTITY_TYPES,
    MAX_ENTITIES,
    entities_prompt,
    entities_schema,
)
from vlmserve.tasks.id_card import IdCardResult, id_card_prompt, id_card_schema, validate_id_card
from vlmserve.tasks.schema import check_schema, parse_json, schema_errors
from vlmserve.tasks.triples import MAX_TRIPLES, triples_prompt, triples_schema

__all__ = [
    "DEFAULT_ENTITY_TYPES",
    "MAX_ENTITIES",
    "MAX_TRIPLES",
    "TASKS",
    "IdCardResult",
    "OutputInvalid",
    "TaskPrompt",
    "check_schema",
    "entities_prompt",
    "entities_schema",
    "id_card_prompt",
    "id_card_schema",
    "json_schema_format",
    "parse_json",
    "schema_errors",
    "triples_prompt",
    "triples_schema",
    "validate_id_card",
]

TASKS: dict[str, str] = {
    "entities": "/v1/extract/entities",
    "triples": "/v1/extract/triples",
    "id_card": "/v1/extract/id-card",
    "ktp_ocr": "/ktp-ocr/",
    "caption": "vlmserve tag",
    "keywords": "vlmserve tag",
    "description": "vlmserve tag",
}
