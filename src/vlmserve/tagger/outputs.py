"""Where tags go: ``<file>.json`` sidecars, one ``tags.jsonl``, or ``<file>.xmp`` sidecars.

Each writer also answers "is this file already tagged?" (same sha256) so runs resume.
Files are replaced atomically (write a temporary file, then rename); ``tags.jsonl`` is
appended per file and compacted to one line per file at the end of the run.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "OUTPUTS",
    "JsonlWriter",
    "SidecarWriter",
    "TagRecord",
    "Writer",
    "XmpWriter",
    "make_writer",
]

NS = {
    "x": "adobe:ns:meta/",
    "rdf": "http://www.w3.org/1999/02/22-rdf-syntax-ns#",
    "dc": "http://purl.org/dc/elements/1.1/",
    "xml": "http://www.w3.org/XML/1998/namespace",
    "vlmserve": "https://vlmserve.dev/ns/tag/1.0/",
}
for _prefix, _uri in NS.items():
    if _prefix != "xml":
        ET.register_namespace(_prefix, _uri)


@dataclass(slots=True)
class TagRecord:
    file: str  # relative to the tagged folder
    sha256: str
    caption: str
    keywords: list[str]
    description: str
    model: str
    tagged_at: str
    models: dict[str, str] = field(default_factory=dict)  # task -> model that answered

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Writer(Protocol):
    def done(self, rel: str, sha256: str) -> bool: ...
    def write(self, record: TagRecord) -> None: ...
    def finish(self) -> None: ...


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class SidecarWriter:
    """``photo.jpg`` -> ``photo.jpg.json`` holding the record."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, rel: str) -> Path:
        return self.root / f"{rel}.json"

    def done(self, rel: str, sha256: str) -> bool:
        try:
            return json.loads(self.path(rel).read_text("utf-8")).get("sha256") == sha256
        except (OSError, ValueError, AttributeError):
            return False

    def write(self, record: TagRecord) -> None:
        _replace(self.path(record.file), json.dumps(record.to_dict(), indent=2) + "\n")

    def finish(self) -> None:
        pass


class JsonlWriter:
    """One ``tags.jsonl`` in the folder; the last line for a file wins."""

    NAME = "tags.jsonl"

    def __init__(self, root: Path):
        self.path = root / self.NAME
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            for line in self.path.read_text("utf-8").splitlines():
                try:
                    record = json.loads(line)
                    self.records[record["file"]] = record
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from an interrupted run
        self._out = self.path.open("a", encoding="utf-8")

    def done(self, rel: str, sha256: str) -> bool:
        return self.records.get(rel, {}).get("sha256") == sha256

    def write(self, record: TagRecord) -> None:
        self.records[record.file] = record.to_dict()
        self._out.write(json.dumps(record.to_dict()) + "\n")
        self._out.flush()

    def finish(self) -> None:
        self._out.close()
        lines = (json.dumps(self.records[k]) + "\n" for k in sorted(self.records))
        _replace(self.path, "".join(lines))


def _q(prefix: str, name: str) -> str:
    return f"{{{NS[prefix]}}}{name}"


def xmp_document(record: TagRecord) -> str:
    """An XMP packet: caption -> dc:title, description -> dc:description, keywords -> dc:subject."""
    root = ET.Element(_q("x", "xmpmeta"))
    rdf = ET.SubElement(root, _q("rdf", "RDF"))
    desc = ET.SubElement(
        rdf,
        _q("rdf", "Description"),
        {
            _q("rdf", "about"): "",
            _q("vlmserve", "sha256"): record.sha256,
            _q("vlmserve", "model"): record.model,
            _q("vlmserve", "taggedAt"): record.tagged_at,
        },
    )
    for tag, text in (("title", record.caption), ("description", record.description)):
        alt = ET.SubElement(ET.SubElement(desc, _q("dc", tag)), _q("rdf", "Alt"))
        ET.SubElement(alt, _q("rdf", "li"), {_q("xml", "lang"): "x-default"}).text = text
    bag = ET.SubElement(ET.SubElement(desc, _q("dc", "subject")), _q("rdf", "Bag"))
    for word in record.keywords:
        ET.SubElement(bag, _q("rdf", "li")).text = word
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=False) + "\n"


class XmpWriter:
    """``photo.jpg`` -> ``photo.jpg.xmp`` (dc:title, dc:description, dc:subject bag)."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, rel: str) -> Path:
        return self.root / f"{rel}.xmp"

    def done(self, rel: str, sha256: str) -> bool:
        try:
            tree = ET.parse(self.path(rel))
        except (OSError, ET.ParseError):
            return False
        found = tree.find(f".//{_q('rdf', 'Description')}")
        return found is not None and found.get(_q("vlmserve", "sha256")) == sha256

    def write(self, record: TagRecord) -> None:
        _replace(self.path(record.file), xmp_document(record))

    def finish(self) -> None:
        pass


OUTPUTS = {"sidecar": SidecarWriter, "jsonl": JsonlWriter, "xmp": XmpWriter}


def make_writer(kind: str, root: Path) -> Writer:
    if kind not in OUTPUTS:
        raise ValueError(f"unknown output {kind!r}; use one of: {', '.join(OUTPUTS)}")
    return OUTPUTS[kind](root)
