"""What xgrammar 0.2.8 enforces in a JSON schema, and the small proofs ``schema_check`` needs.

The keyword tables were established by compiling schemas with and without each keyword and
comparing the EBNF xgrammar produced (and its warnings: "ignoring multipleOf", "Lookahead
assertion is not supported and is ignored", "Anchor '^' in the middle of regex is ignored",
"pattern combined with minLength/maxLength is not supported"). tests/unit/engine/hf/test_grammar.py
pins the cases a user relies on.
"""

from __future__ import annotations

import json
from typing import Any

from vlmserve.errors import InvalidRequest, UnsupportedFeature

__all__ = [
    "ANNOTATIONS",
    "ARRAY_KEYS",
    "COMBINATORS",
    "JSON_CHAR",
    "NUMBER_KEYS",
    "OBJECT_KEYS",
    "STRING_FORMATS",
    "STRING_KEYS",
    "TYPES",
    "UNSUPPORTED",
    "check_one_of",
    "resolve_ref",
    "rewrite_pattern",
    "type_matches",
]

TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
# Keywords that constrain nothing (validators ignore them too).
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$schema",
        "$id",
        "$anchor",
        "discriminator",  # OpenAPI/pydantic annotation next to oneOf
    }
)
COMBINATORS = frozenset({"anyOf", "oneOf", "allOf"})
STRING_KEYS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
OBJECT_KEYS = frozenset(
    {
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
        "minProperties",
        "maxProperties",
    }
)
ARRAY_KEYS = frozenset({"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"})
# Formats xgrammar turns into a grammar; any other format is accepted as a plain string by it.
STRING_FORMATS = frozenset(
    {
        "date",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "json-pointer",
        "relative-json-pointer",
        "time",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
    }
)
_CANNOT = "xgrammar cannot enforce it while decoding"
# Validation keywords xgrammar ignores: the output could violate them.
UNSUPPORTED = {
    "not": f"{_CANNOT}; list the allowed alternatives with anyOf or enum",
    "if": f"{_CANNOT}; use anyOf over the allowed shapes",
    "then": f"{_CANNOT}; use anyOf over the allowed shapes",
    "else": f"{_CANNOT}; use anyOf over the allowed shapes",
    "dependentRequired": f"{_CANNOT}; use anyOf over the allowed shapes",
    "dependentSchemas": f"{_CANNOT}; use anyOf over the allowed shapes",
    "dependencies": f"{_CANNOT}; use anyOf over the allowed shapes",
    "uniqueItems": f"{_CANNOT}; remove it and de-duplicate the items afterwards",
    "contains": _CANNOT,
    "minContains": _CANNOT,
    "maxContains": _CANNOT,
    "propertyNames": f"{_CANNOT}; use patternProperties or list the properties",
    "contentSchema": _CANNOT,
    "additionalItems": f"{_CANNOT}; use prefixItems and items",
    "$dynamicRef": f"{_CANNOT}; use $ref",
    "$dynamicAnchor": f"{_CANNOT}; use $ref",
    "$recursiveRef": f"{_CANNOT}; use $ref",
    "$recursiveAnchor": f"{_CANNOT}; use $ref",
}


def _unsupported(message: str) -> UnsupportedFeature:
    return UnsupportedFeature(f"response_format: {message}", param="response_format")


# One character of a JSON string without escapes: printable ASCII but '"' and '\\', or a
# well-formed UTF-8 character. Split at UTF-8 lead-byte boundaries because xgrammar's regex
# classes check the code point but not the encoding: a wider range such as [\u00a0-\ud7ff] (or
# '.') also accepts overlong forms like E0 8E AB, which decode to U+FFFD x3 and break lengths.
JSON_CHAR = (
    "(?:[ !#-\\[\\]-~]|[\\u0080-\\u07ff]|[\\u0800-\\u0fff]|[\\u1000-\\ucfff]|[\\ud000-\\ud7ff]"
    "|[\\ue000-\\uffff]|[\\u{10000}-\\u{3ffff}]|[\\u{40000}-\\u{fffff}]|[\\u{100000}-\\u{10ffff}])"
)


def rewrite_pattern(pattern: str) -> tuple[str, str | None]:
    """(pattern for xgrammar, problem): '.' becomes JSON_CHAR; problem names what xgrammar
    would silently drop or refuse (None when there is nothing).

    xgrammar matches a pattern against the whole string (stricter than JSON Schema's search,
    so still valid), ignores lookaround and anchors in the middle, and refuses backreferences.
    """
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            nxt = pattern[i + 1 : i + 2]
            if not in_class and (nxt in set("123456789") or nxt == "k"):
                return pattern, "a backreference"
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            step = 2 if pattern[i + 1 : i + 2] == "]" else 1  # a leading ']' is a literal
            out.append(pattern[i : i + step])
            i += step
            continue
        elif char == "(" and pattern[i + 1 : i + 3] in ("?=", "?!"):
            return pattern, "a lookahead"
        elif char == "(" and pattern[i + 1 : i + 4] in ("?<=", "?<!"):
            return pattern, "a lookbehind"
        elif (char == "^" and i != 0) or (char == "$" and i != len(pattern) - 1):
            return pattern, f"the anchor {char!r} inside the pattern (only at its start or end)"
        out.append(JSON_CHAR if char == "." and not in_class else char)
        i += 1
    return "".join(out), None


def resolve_ref(root: Any, ref: str, path: str) -> Any:
    """The schema a local ``$ref`` ('#', '#/$defs/Name') points to; 400 when it is missing."""
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise InvalidRequest(
                f"response_format: $ref {ref!r} at {path} points to nothing in the schema",
                param="response_format",
            )
    return node


def type_matches(value: Any, name: str) -> bool:
    if name == "integer":
        if isinstance(value, bool):
            return False
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    kinds: dict[str, Any] = {
        "string": str,
        "number": int | float,
        "boolean": bool,
        "null": type(None),
        "object": dict,
        "array": list,
    }
    if name == "number" and isinstance(value, bool):
        return False
    return isinstance(value, kinds[name])


def check_one_of(root: Any, branches: list[Any], path: str) -> None:
    """xgrammar treats oneOf as anyOf: only accept branches that can never both match."""
    resolved = [_deref(root, b, path) for b in branches]
    for i in range(len(resolved)):
        for j in range(i + 1, len(resolved)):
            if not _disjoint(root, resolved[i], resolved[j], path):
                raise _unsupported(
                    f"oneOf at {path}: branches {i} and {j} may both match, which oneOf forbids "
                    "and the grammar cannot prevent; use anyOf, or make the branches differ by "
                    "type or by a required property with different const values"
                )


def _deref(root: Any, schema: Any, path: str) -> Any:
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
        schema = resolve_ref(root, schema["$ref"], path)
        seen += 1
    return schema


def _kinds(schema: Any) -> set[str] | None:
    """JSON types a (dereferenced) branch can produce; None when unknown."""
    if not isinstance(schema, dict):
        return None
    finite = _finite(schema)
    if finite is not None:
        return {k for v in finite for k in TYPES if type_matches(v, k)} - {"integer"}
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return {"number" if n == "integer" else n for n in names}
    if "properties" in schema:
        return {"object"}
    if "items" in schema or "prefixItems" in schema:
        return {"array"}
    return None


def _finite(schema: dict) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return list(schema["enum"])
    return None


def _canon(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # 1 and 1.0 are the same JSON number
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value)
    return json.dumps(value, sort_keys=True)


def _disjoint(root: Any, a: Any, b: Any, path: str) -> bool:
    kinds_a, kinds_b = _kinds(a), _kinds(b)
    if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
        return True
    fa = _finite(a) if isinstance(a, dict) else None
    fb = _finite(b) if isinstance(b, dict) else None
    if fa is not None and fb is not None:
        return not _canons(fa) & _canons(fb)
    if kinds_a != {"object"} or kinds_b != {"object"}:
        return False
    # Discriminated objects: a property required by both, with non-overlapping const/enum values.
    shared = set(a.get("required", [])) & set(b.get("required", []))
    for name in sorted(shared):
        pa = _deref(root, a.get("properties", {}).get(name), path)
        pb = _deref(root, b.get("properties", {}).get(name), path)
        va = _finite(pa) if isinstance(pa, dict) else None
        vb = _finite(pb) if isinstance(pb, dict) else None
        if va is not None and vb is not None and not _canons(va) & _canons(vb):
            return True
    return False


def _canons(values: list[Any]) -> set[str]:
    return {_canon(v) for v in values}
