"""Walk a JSON schema before xgrammar sees it: refuse what it would silently not enforce.

xgrammar 0.2.8 enforces most of JSON Schema (types, properties/required, additionalProperties,
patternProperties, min/maxProperties, items/prefixItems, min/maxItems, enum, const, anyOf,
single-entry allOf, local $ref/$defs, min/maxLength, pattern, 14 string formats,
minimum/maximum/exclusive*, integer multipleOf). Every other constraint is dropped with at most
a log line, so the output could violate the schema. Those are a 400 here, naming the keyword
and where it is (``$.properties.tags.items``):

- keywords it ignores (``not``, ``if``, ``uniqueItems``, ``contains``, ``propertyNames``, ...);
- keywords it ignores in combination: siblings of ``$ref``/``anyOf``/``oneOf``/``allOf``/``enum``,
  ``pattern``/``format`` together with a length, number-valued ``multipleOf``, string or number
  keywords without a ``type``, ``required`` names missing from ``properties``, ``oneOf``
  branches that may overlap, ``patternProperties`` that also match a declared property;
- regex features it drops (lookaround, anchors in the middle), unknown ``format`` values.

One rewrite: an unescaped '.' in a ``pattern`` becomes an exact class of well-formed UTF-8
characters (xgrammar's '.' also accepts overlong byte sequences, which decode to U+FFFD x3).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from vlmserve.engine.hf.schema_rules import (
    ANNOTATIONS,
    ARRAY_KEYS,
    COMBINATORS,
    NUMBER_KEYS,
    OBJECT_KEYS,
    STRING_FORMATS,
    STRING_KEYS,
    TYPES,
    UNSUPPORTED,
    check_one_of,
    resolve_ref,
    rewrite_pattern,
    type_matches,
)
from vlmserve.errors import InvalidRequest, UnsupportedFeature

__all__ = ["MAX_DEPTH", "check_schema"]

MAX_DEPTH = 32  # nesting of subschemas; deeper is refused (and never reaches recursion limits)
_PARAM = "response_format"
_STRUCTURAL = frozenset({"$defs", "definitions"})


def _unsupported(message: str) -> UnsupportedFeature:
    return UnsupportedFeature(f"response_format: {message}", param=_PARAM)


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(f"response_format: {message}", param=_PARAM)


def check_schema(schema: Any) -> Any:
    """A copy of ``schema`` that xgrammar enforces exactly; 400 for anything it would not."""
    if not isinstance(schema, dict | bool):
        raise _invalid("json_schema.schema must be a JSON object (a JSON schema)")
    out = copy.deepcopy(schema)
    _Walker(out).node(out, "$", 0)
    return out


class _Walker:
    def __init__(self, root: Any):
        self.root = root

    def node(self, schema: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _invalid(f"the schema nests deeper than {MAX_DEPTH} levels at {path}")
        if isinstance(schema, bool):
            if not schema:
                raise _unsupported(f"the schema 'false' at {path} can never be satisfied")
            return
        if not isinstance(schema, dict):
            raise _invalid(f"the schema at {path} must be an object or a boolean")
        for key in sorted(schema.keys() & UNSUPPORTED.keys()):
            if key != "uniqueItems" or schema[key] is not False:
                raise _unsupported(
                    f"JSON schema keyword {key!r} at {path} is not supported: {UNSUPPORTED[key]}"
                )
        for key in _STRUCTURAL & schema.keys():
            self._defs(schema[key], f"{path}.{key}", depth)
        types = _types(schema, path)
        if self._exclusive(schema, path, depth, types):
            return
        self._strings(schema, path, types)
        self._numbers(schema, path, types)
        self._objects(schema, path, depth)
        self._arrays(schema, path, depth)

    def _defs(self, defs: Any, path: str, depth: int) -> None:
        if not isinstance(defs, dict):
            raise _invalid(f"{path} must be an object of named schemas")
        for name, sub in defs.items():
            self.node(sub, f"{path}.{name}", depth + 1)

    def _exclusive(self, schema: dict, path: str, depth: int, types: set[str] | None) -> bool:
        """$ref, combinators, enum/const: xgrammar uses them alone and drops their siblings."""
        if "$ref" in schema:
            _only(schema, "$ref", path, set())
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise _unsupported(
                    f"$ref {ref!r} at {path} is not supported: only local references into this "
                    "schema ('#/$defs/Name') are; copy the referenced schema under $defs"
                )
            resolve_ref(self.root, ref, path)
            return True
        kinds = COMBINATORS & schema.keys()
        if kinds:
            self._combinator(schema, sorted(kinds), path, depth)
            return True
        if "enum" in schema or "const" in schema:
            self._finite(schema, path, types)
            return True
        return False

    def _combinator(self, schema: dict, kinds: list[str], path: str, depth: int) -> None:
        if len(kinds) > 1:
            raise _unsupported(
                f"{kinds[0]!r} and {kinds[1]!r} together at {path} are not supported"
            )
        kind = kinds[0]
        _only(schema, kind, path, set())
        branches = schema[kind]
        if not isinstance(branches, list) or not branches:
            raise _invalid(f"{kind} at {path} must be a non-empty array of schemas")
        if kind == "allOf" and len(branches) > 1:
            raise _unsupported(
                f"JSON schema keyword 'allOf' with {len(branches)} schemas at {path} is not "
                "supported (only one); merge them into a single schema"
            )
        for i, branch in enumerate(branches):
            self.node(branch, f"{path}.{kind}[{i}]", depth + 1)
        if kind == "oneOf":
            check_one_of(self.root, branches, path)

    def _finite(self, schema: dict, path: str, types: set[str] | None) -> None:
        key = "enum" if "enum" in schema else "const"
        _only(schema, key, path, {"type"})
        values = schema["enum"] if key == "enum" else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise _invalid(f"enum at {path} must be a non-empty array")
        for value in values:
            if types is not None and not any(type_matches(value, t) for t in types):
                raise _invalid(f"{key} value {value!r} at {path} is not of type {sorted(types)}")

    def _strings(self, schema: dict, path: str, types: set[str] | None) -> None:
        present = STRING_KEYS & schema.keys()
        if not present:
            return
        _need_type(present, {"string"}, types, path)
        lengths = [_non_negative(schema, k, path) for k in ("minLength", "maxLength")]
        for key in ("pattern", "format"):
            if key not in schema:
                continue
            if not isinstance(schema[key], str):
                raise _invalid(f"{key} at {path} must be a string")
            if lengths != [None, None]:
                raise _unsupported(
                    f"{key!r} together with minLength/maxLength at {path} is not supported; "
                    "put the length into the pattern instead, e.g. ^[a-z]{1,20}$"
                )
        if "format" in schema and schema["format"] not in STRING_FORMATS:
            raise _unsupported(
                f"format {schema['format']!r} at {path} is not supported; supported formats: "
                f"{', '.join(sorted(STRING_FORMATS))} (or describe it with 'pattern')"
            )
        if "pattern" in schema:
            schema["pattern"] = _check_pattern(schema["pattern"], f"{path}.pattern")
        low, high = lengths
        if low is not None and high is not None and low > high:
            raise _invalid(f"minLength {low} is greater than maxLength {high} at {path}")

    def _numbers(self, schema: dict, path: str, types: set[str] | None) -> None:
        present = NUMBER_KEYS & schema.keys()
        if not present:
            return
        _need_type(present, {"integer", "number"}, types, path)
        for key in present:
            value = schema[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _invalid(f"{key} at {path} must be a number, got {value!r}")
        if "multipleOf" not in schema:
            return
        step = schema["multipleOf"]
        if step <= 0:
            raise _invalid(f"multipleOf at {path} must be greater than 0")
        if "number" in (types or set()) or float(step) != int(step):
            raise _unsupported(
                f"JSON schema keyword 'multipleOf' at {path} is only supported with "
                '"type": "integer" and a whole-number step'
            )

    def _objects(self, schema: dict, path: str, depth: int) -> None:
        if not OBJECT_KEYS & schema.keys():
            return
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise _invalid(f"properties at {path} must be an object")
        for name, sub in props.items():
            self.node(sub, f"{path}.properties.{name}", depth + 1)
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise _invalid(f"required at {path} must be an array of property names")
        for name in required:
            if name not in props:
                raise _unsupported(
                    f"required property {name!r} at {path} is not listed in 'properties'; "
                    "declare it there (with its schema)"
                )
        for key in ("minProperties", "maxProperties"):
            _non_negative(schema, key, path)
        for key in ("additionalProperties", "unevaluatedProperties"):
            if key in schema and schema[key] is not False:
                self.node(schema[key], f"{path}.{key}", depth + 1)
        self._pattern_properties(schema.get("patternProperties"), props, path, depth)

    def _pattern_properties(self, pp: Any, props: dict, path: str, depth: int) -> None:
        if pp is None:
            return
        if not isinstance(pp, dict):
            raise _invalid(f"patternProperties at {path} must be an object")
        for pattern, sub in pp.items():
            where = f"{path}.patternProperties.{pattern}"
            _check_pattern(pattern, where)
            self.node(sub, where, depth + 1)
            try:
                clash = [name for name in props if re.search(pattern, name)]
            except re.error as exc:
                message = f"pattern {pattern!r} at {where} is not a valid regex: {exc}"
                raise _invalid(message) from None
            if clash:
                raise _unsupported(
                    f"patternProperties {pattern!r} at {path} also matches the declared property "
                    f"{clash[0]!r}, whose value would then have to satisfy both schemas; this is "
                    "not supported: make the pattern exclude declared names"
                )

    def _arrays(self, schema: dict, path: str, depth: int) -> None:
        if not ARRAY_KEYS & schema.keys():
            return
        items = schema.get("items", True)
        if isinstance(items, list):
            raise _invalid(f"items at {path} must be a schema; for tuples use prefixItems")
        if items is not False:
            self.node(items, f"{path}.items", depth + 1)
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise _invalid(f"prefixItems at {path} must be an array of schemas")
        for i, sub in enumerate(prefix):
            self.node(sub, f"{path}.prefixItems[{i}]", depth + 1)
        if schema.get("unevaluatedItems", False) is not False:
            self.node(schema["unevaluatedItems"], f"{path}.unevaluatedItems", depth + 1)
        for key in ("minItems", "maxItems"):
            _non_negative(schema, key, path)


def _types(schema: dict, path: str) -> set[str] | None:
    if "type" not in schema:
        return None
    value = schema["type"]
    names = value if isinstance(value, list) else [value]
    if not names or not all(isinstance(n, str) and n in TYPES for n in names):
        raise _invalid(
            f"type at {path} must be one of {', '.join(sorted(TYPES))} or a non-empty array of "
            f"them, got {value!r}"
        )
    return set(names)


def _only(schema: dict, keyword: str, path: str, allowed: set[str]) -> None:
    """xgrammar honours ``keyword`` alone: any other constraint beside it would be dropped."""
    for key in schema:
        if key == keyword or key in allowed or key in ANNOTATIONS or key in _STRUCTURAL:
            continue
        if key in UNSUPPORTED or key in STRING_KEYS | NUMBER_KEYS | OBJECT_KEYS | ARRAY_KEYS | {
            "type",
            "enum",
            "const",
        }:
            raise _unsupported(
                f"JSON schema keyword {key!r} next to {keyword!r} at {path} is not supported; "
                f"move it inside the {keyword} schema(s)"
            )


def _need_type(present: set[str], wanted: set[str], types: set[str] | None, path: str) -> None:
    if types is None or not types & wanted:
        key = sorted(present)[0]
        raise _unsupported(
            f'JSON schema keyword {key!r} at {path} needs an explicit "type" of '
            f"{' or '.join(sorted(wanted))} to be enforced; add it"
        )


def _non_negative(schema: dict, key: str, path: str) -> int | None:
    if key not in schema:
        return None
    value = schema[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _invalid(f"{key} at {path} must be a non-negative integer, got {schema[key]!r}")
    return value


def _check_pattern(pattern: Any, path: str) -> str:
    """The pattern as xgrammar should get it; 400 for what it would drop or refuse."""
    if not isinstance(pattern, str):
        raise _invalid(f"the pattern at {path} must be a string")
    rewritten, problem = rewrite_pattern(pattern)
    if problem:
        raise _unsupported(f"pattern {pattern!r} at {path}: {problem} is not supported")
    return rewritten
