"""Registry files: curated + discovered -> one merged ``Registry``, and writing them back.

Layering. The *curated* file is written by people; the *discovered* file by tools that scan
for models. Entries are keyed by ``name``; where both files hold a name the curated entry
replaces the discovered one WHOLE (fields are not merged: a curated entry says everything
about its model). The merged order is the curated file's order, then discovered-only
entries sorted by name; ``role:<role>`` picks the first non-deprecated entry in that order.
The snapshot (``write_snapshot``) is sorted by name and byte-for-byte reproducible.

Formats, chosen by extension: ``.toml`` with ``[[models]]`` tables, or ``.json`` holding
``{"models": [...]}``. A discovered file that does not exist yet counts as empty.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vlmserve.errors import ConfigError
from vlmserve.registry.entries import ModelEntry, VersionLock
from vlmserve.registry.resolve import resolve

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "Registry",
    "dumps_toml",
    "load_registry",
    "merge_entries",
    "read_entries",
    "write_document",
    "write_locks",
    "write_snapshot",
]

log = logging.getLogger(__name__)
CURATED, DISCOVERED = "curated", "discovered"


class Registry:
    """The merged entries, in resolution order, and an index of every identifier."""

    __slots__ = ("_entries", "_index", "_origins")

    def __init__(self, entries: Iterable[ModelEntry], origins: Mapping[str, str] | None = None):
        self._entries = tuple(entries)
        self._index = _index(self._entries)
        self._origins = dict(origins or {})

    @property
    def entries(self) -> tuple[ModelEntry, ...]:
        return self._entries

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self._entries]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[ModelEntry]:
        return iter(self._entries)

    def get(self, name: str) -> ModelEntry | None:
        """The entry named exactly ``name`` (no alias or role lookup), or None."""
        return next((entry for entry in self._entries if entry.name == name), None)

    def origin(self, name: str) -> str:
        """``"curated"`` or ``"discovered"``: which file the entry came from."""
        return self._origins.get(name, CURATED)

    def roles(self) -> list[str]:
        return sorted({role for entry in self._entries for role in entry.roles})

    def resolve(self, query: str) -> ModelEntry:
        """By name, alias, served id, or ``role:<role>`` (``registry.resolve``'s rules)."""
        return resolve(self._entries, query, self._index.get, "in the registry")


def _index(entries: tuple[ModelEntry, ...]) -> dict[str, ModelEntry]:
    """identifier -> entry name; an identifier claimed by two entries is a ``ConfigError``."""
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise ConfigError(f"two registry entries are named {entry.name!r}; rename one")
        seen.add(entry.name)
    owners: dict[str, tuple[ModelEntry, str]] = {}  # identifier -> (entry, what it is there)
    kinds = (
        ("name", lambda e: [e.name]),
        ("served_model_id", lambda e: [e.served_id]),
        ("alias", lambda e: e.model_aliases),
    )
    for kind, identifiers in kinds:  # names first, so messages say "alias of A = name of B"
        for entry in entries:
            for ident in identifiers(entry):
                owner, what = owners.setdefault(ident, (entry, kind))
                if owner is not entry:
                    raise ConfigError(
                        f"{kind} {ident!r} of entry {entry.name!r} is also the {what} of "
                        f"entry {owner.name!r}; identifiers must be unique: rename or drop one"
                    )
    return {ident: owner for ident, (owner, _) in owners.items()}


def load_registry(curated: Path, discovered: Path | None = None) -> Registry:
    """Read both layers and merge them (curated wins by name, whole entry)."""
    mine = read_entries(curated)
    found: list[ModelEntry] = []
    if discovered is not None:
        if discovered.exists():
            found = read_entries(discovered)
        else:
            log.info("discovered registry %s does not exist yet; using the curated one", discovered)
    curated_names = {entry.name for entry in mine}
    origins = {e.name: DISCOVERED for e in found if e.name not in curated_names}
    return Registry(merge_entries(mine, found), origins)


def merge_entries(curated: list[ModelEntry], discovered: list[ModelEntry]) -> list[ModelEntry]:
    """Curated entries in file order, then discovered-only entries sorted by name."""
    taken = {entry.name for entry in curated}
    rest = sorted((e for e in discovered if e.name not in taken), key=lambda e: e.name)
    return [*curated, *rest]


def read_document(path: Path) -> dict[str, Any]:
    """A registry file parsed (TOML or JSON by extension), not yet validated."""
    if not path.is_file():
        raise ConfigError(f"registry file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            doc: Any = tomllib.loads(text)
        elif suffix == ".json":
            doc = json.loads(text)
        else:
            raise ConfigError(f"registry file {path} must end in .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = suffix[1:].upper()
        raise ConfigError(f"registry file {path} is not valid {kind}: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"registry file {path} must hold an object with a `models` list")
    unknown = sorted(set(doc) - {"models"})
    if unknown:
        raise ConfigError(
            f"registry file {path} has unknown top-level keys {unknown}; it holds only `models`"
        )
    models = doc.setdefault("models", [])
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ConfigError(f"registry file {path}: `models` must be a list of tables/objects")
    return doc


def read_entries(path: Path) -> list[ModelEntry]:
    """The validated entries of one file, in file order; a name used twice is an error."""
    entries: list[ModelEntry] = []
    for i, raw in enumerate(read_document(path)["models"]):
        try:
            entry = ModelEntry.model_validate(raw)
        except ValidationError as exc:
            label = f"models[{i}] ({raw.get('name', 'no name')})"
            raise ConfigError(f"registry file {path}, {label}: {_explain(exc)}") from None
        if any(e.name == entry.name for e in entries):
            raise ConfigError(f"registry file {path} names {entry.name!r} twice; rename one")
        entries.append(entry)
    return entries


def _explain(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "entry"
        parts.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def write_snapshot(registry: Registry, path: Path) -> None:
    """The merged registry as JSON, sorted by name and key: same registry, same bytes."""
    models = [e.model_dump(mode="json") for e in sorted(registry, key=lambda e: e.name)]
    text = json.dumps({"models": models}, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    _write_atomically(path, text)


def write_document(path: Path, doc: Mapping[str, Any]) -> None:
    """A registry document as TOML (``.toml``) or JSON (any other suffix), atomically."""
    if path.suffix == ".toml":
        text = dumps_toml(doc)
    else:
        text = json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    _write_atomically(path, text)


def write_locks(curated: Path, locks: Mapping[str, VersionLock]) -> bool:
    """Set ``version_lock`` of the named curated entries, keeping every other entry as is.

    TOML: the lock tables of each entry are replaced in place, so comments and layout
    survive; if the file is laid out in a way that edit cannot handle (checked by parsing
    the result), the whole file is rewritten by ``dumps_toml`` and False is returned
    (comments lost). JSON keeps its key order. Returns True when comments were preserved.
    """
    doc = read_document(curated)
    where = {model.get("name"): i for i, model in enumerate(doc["models"])}
    outside = sorted(set(locks) - set(where))
    if outside:
        raise ConfigError(
            f"{', '.join(outside)} not in the curated file {curated}; copy the entry there "
            "to lock it (discovered entries are not edited)"
        )
    expected = copy.deepcopy(doc)
    by_index = {where[name]: lock.model_dump(mode="json") for name, lock in locks.items()}
    for i, lock_table in by_index.items():
        expected["models"][i]["version_lock"] = lock_table
    if curated.suffix.lower() == ".json":
        _write_atomically(curated, json.dumps(expected, indent=2, ensure_ascii=False) + "\n")
        return True
    patched = patch_toml_locks(curated.read_text(encoding="utf-8"), by_index)
    if patched is not None and tomllib.loads(patched) == expected:
        _write_atomically(curated, patched)
        return True
    _write_atomically(curated, dumps_toml(expected))
    return False


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- TOML writing ------------------------------------------------------------------------
# A small writer for the registry schema: tables of strings, numbers, bools, dates, lists,
# nested tables and arrays of tables. Keys keep their order; within a table, plain keys
# come first, then sub-tables, then arrays of tables (TOML requires that order).

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\s]+?)\s*(\]\]?)\s*(#.*)?$")
_LOCK_TABLE = "models.version_lock"


def dumps_toml(doc: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> str:
    """``doc`` as TOML; the same ``doc`` always gives the same text. None values are left out."""
    lines: list[str] = []
    _emit_table(lines, prefix, doc, header=None)
    return "\n".join(lines).lstrip("\n") + "\n"


def _emit_table(
    lines: list[str], path: tuple[str, ...], table: Mapping[str, Any], header: str | None
) -> None:
    def is_table_array(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)

    plain = [(k, v) for k, v in table.items() if v is not None]
    tables = [(k, v) for k, v in plain if isinstance(v, Mapping)]
    arrays = [(k, v) for k, v in plain if is_table_array(v)]
    if header is not None:
        lines.extend(["", header])
    for key, value in plain:
        if not isinstance(value, Mapping) and not is_table_array(value):
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in tables:
        sub = (*path, key)
        _emit_table(lines, sub, value, f"[{'.'.join(map(_toml_key, sub))}]")
    for key, items in arrays:
        sub = (*path, key)
        for item in items:
            _emit_table(lines, sub, item, f"[[{'.'.join(map(_toml_key, sub))}]]")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # JSON's escapes (\" \\ \n \t \uXXXX ...) are valid TOML; JSON leaves DEL raw, TOML does not.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise ConfigError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def patch_toml_locks(text: str, locks: Mapping[int, Mapping[str, Any]]) -> str | None:
    """Replace the ``version_lock`` tables of the i-th ``[[models]]`` tables in ``text``.

    Line-based, so comments and layout elsewhere survive. None when the file does not use
    one ``[[models]]`` header per entry; the caller checks the result by parsing it.
    """
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    starts = [i for i, line in enumerate(lines) if _header(line) == ("[[", "models")]
    if any(i >= len(starts) for i in locks):
        return None
    bounds = [*starts, len(lines)]
    for i in sorted(locks, reverse=True):  # from the end, so earlier bounds stay valid
        lo, hi = bounds[i], bounds[i + 1]
        segment = _without_lock_tables(lines[lo:hi])
        last = max(j for j, line in enumerate(segment) if not _is_trivia(line))
        tail = segment[last + 1 :]
        while tail and not tail[0].strip():
            tail.pop(0)
        block = dumps_toml({"version_lock": dict(locks[i])}, prefix=("models",))
        new = [*segment[: last + 1], "\n", *block.splitlines(keepends=True)]
        if tail or hi < len(lines):
            new.append("\n")
        lines[lo:hi] = [*new, *tail]
    return "".join(lines)


def _header(line: str) -> tuple[str, str] | None:
    match = _HEADER.match(line)
    if match is None or len(match.group(1)) != len(match.group(3)):
        return None
    return match.group(1), re.sub(r"\s*\.\s*", ".", match.group(2))


def _is_trivia(line: str) -> bool:
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _without_lock_tables(segment: list[str]) -> list[str]:
    """Drop ``[models.version_lock*]`` tables; comments trailing them (next entry's) stay."""
    kept: list[str] = []
    pending: list[str] = []
    skipping = False
    for line in segment:
        header = _header(line)
        if header is not None:
            kept.extend(pending)
            pending = []
            key = header[1]
            skipping = key == _LOCK_TABLE or key.startswith(_LOCK_TABLE + ".")
            if not skipping:
                kept.append(line)
        elif not skipping:
            kept.append(line)
        elif _is_trivia(line):
            pending.append(line)
        else:
            pending = []
    return kept + pending
