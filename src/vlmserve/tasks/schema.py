"""A small JSON Schema checker for the subset structured output uses, and output parsing.

Constrained decoding (``response_format`` json_schema) should make every answer parse and
validate; this module checks that it did, because an upstream may ignore ``response_format``
or an answer may be cut off by ``max_tokens``. No ``jsonschema`` dependency: the keywords
checked are the ones task schemas use (``type``, ``properties``, ``required``,
``additionalProperties``, ``items``, ``enum``, ``const``, ``minItems``/``maxItems``,
``minLength``/``maxLength``, ``minimum``/``maximum``, ``anyOf``/``oneOf``, local ``$ref``);
others are accepted and ignored (the engine's grammar enforces what it can).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["MAX_SCHEMA_BYTES", "check_schema", "parse_json", "schema_errors"]

MAX_SCHEMA_BYTES = 64 * 1024
_MAX_DEPTH = 32
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES.get(name, (object,)))


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    node: Any = root
    for key in ref[2:].split("/"):
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def _scalar_errors(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} is not {schema['const']!r}")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
    if _is_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")
    return errors


def _object_errors(value: dict, schema: dict[str, Any], path: str, ctx: tuple) -> list[str]:
    errors = [
        f"{path}: missing required key {k!r}" for k in schema.get("required", []) if k not in value
    ]
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in props:
            errors += _errors(item, props[key], f"{path}.{key}", ctx)
        elif extra is False:
            errors.append(f"{path}: unexpected key {key!r}")
        elif isinstance(extra, dict):
            errors += _errors(item, extra, f"{path}.{key}", ctx)
    return errors


def _array_errors(value: list, schema: dict[str, Any], path: str, ctx: tuple) -> list[str]:
    errors = []
    if len(value) > schema.get("maxItems", len(value)):
        errors.append(f"{path}: more than {schema['maxItems']} items")
    if len(value) < schema.get("minItems", 0):
        errors.append(f"{path}: fewer than {schema['minItems']} items")
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            errors += _errors(item, items, f"{path}[{i}]", ctx)
    return errors


def _errors(value: Any, schema: Any, path: str, ctx: tuple) -> list[str]:
    root, depth = ctx
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return []
    schema = _resolve(schema, root)
    inner = (root, depth + 1)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if (
            isinstance(options, list)
            and options
            and all(_errors(value, o, path, inner) for o in options)
        ):
            return [f"{path}: matches none of the {key} alternatives"]
    wanted = schema.get("type")
    names = [wanted] if isinstance(wanted, str) else (wanted or [])
    if names and not any(_is_type(value, n) for n in names):
        return [f"{path}: expected {' or '.join(names)}, got {type(value).__name__}"]
    errors = _scalar_errors(value, schema, path)
    if isinstance(value, dict):
        errors += _object_errors(value, schema, path, inner)
    elif isinstance(value, list):
        errors += _array_errors(value, schema, path, inner)
    return errors


def schema_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """Every way ``value`` breaks ``schema`` (paths like ``$.entities[0].type``); [] if none."""
    return _errors(value, schema, "$", (schema, 0))


def check_schema(schema: Any, param: str = "schema") -> dict[str, Any]:
    """A caller-supplied schema, checked for shape and size; raises ValueError saying why."""
    if not isinstance(schema, dict):
        raise ValueError(f"{param} must be a JSON object (a JSON Schema)")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ValueError(f"{param} is larger than {MAX_SCHEMA_BYTES} bytes of JSON")
    kind = schema.get("type")
    if kind not in (None, "object") and not (isinstance(kind, list) and "object" in kind):
        raise ValueError(f'{param} must describe a JSON object ("type": "object"), not {kind!r}')
    return schema


def parse_json(text: str) -> Any:
    """The model's answer as JSON (a ```json fence around it is tolerated); ValueError if not."""
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    try:
        return json.loads(body, parse_float=_finite, parse_constant=_not_a_number)
    except json.JSONDecodeError as exc:
        where = f"{exc.msg} at character {exc.pos}"
        raise ValueError(f"the model's answer is not valid JSON ({where})") from exc
    except OverflowError as exc:  # e.g. 1e999: valid JSON, but no float can hold it
        raise ValueError(f"the model's answer holds a number out of range ({exc})") from exc


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise OverflowError(text)
    return value


def _not_a_number(text: str) -> Any:
    raise OverflowError(text)
