"""``vlmserve registry discover ROOT``: the registry's *discovered* layer, from a model folder.

Every directory under ROOT (two levels deep, for ``org/name`` layouts) that holds a
``config.json`` becomes one ``hf`` entry: its name (the directory's, made a valid id), source,
architecture, what it takes (``vision`` when the config has a vision tower, ``video`` when it
also ships a video processor and a chat template that renders video), its quantization
method and its size on disk. Nothing is loaded: the files are read as they are. The curated
file still wins by name (``registry.files.merge_entries``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from vlmserve.registry.entries import Capabilities, ModelEntry

__all__ = ["discover", "discovered_document"]

_NOT_ID = re.compile(r"[^A-Za-z0-9._-]+")
_TEMPLATE_FILES = (
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "tokenizer_config.json",
)
_VIDEO_FILES = ("video_preprocessor_config.json",)


def discover(root: Path) -> list[ModelEntry]:
    """One entry per checkpoint directory under ``root``, sorted by name."""
    found = {}
    for config in (
        sorted(root.glob("config.json"))
        + sorted(root.glob("*/config.json"))
        + sorted(root.glob("*/*/config.json"))
    ):
        entry = _entry(root, config.parent)
        if entry is not None:
            found.setdefault(entry.name, entry)
    return sorted(found.values(), key=lambda e: e.name)


def discovered_document(entries: list[ModelEntry]) -> dict[str, Any]:
    """The discovered layer as a registry document (``{"models": [...]}``)."""
    return {
        "models": [
            e.model_dump(mode="json", exclude_defaults=True) | {"name": e.name} for e in entries
        ]
    }


def _entry(root: Path, folder: Path) -> ModelEntry | None:
    config = _json(folder / "config.json")
    architectures = config.get("architectures") or []
    if not architectures:
        return None  # not a model checkpoint (a tokenizer, an adapter, ...)
    relative = folder.relative_to(root).as_posix() if folder != root else folder.name
    vision = any(k in config for k in ("vision_config", "vision_tower", "mm_vision_tower"))
    quant = (config.get("quantization_config") or {}).get("quant_method")
    return ModelEntry(
        name=_NOT_ID.sub("-", relative).strip("-._") or "model",
        source=str(folder.resolve()),
        capabilities=Capabilities(vision=vision, video=vision and _takes_video(folder)),
        architecture=str(architectures[0]),
        quantization=str(quant) if quant else None,
        size_bytes=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
    )


def _takes_video(folder: Path) -> bool:
    """A video processor is shipped and the chat template renders video parts."""
    if not any((folder / name).is_file() for name in _VIDEO_FILES):
        processor = _json(folder / "processor_config.json")
        if "video_processor" not in processor:
            return False
    return any("video" in _template_text(folder / name) for name in _TEMPLATE_FILES)


def _template_text(path: Path) -> str:
    if not path.is_file():
        return ""
    if path.suffix == ".jinja":
        return path.read_text(encoding="utf-8", errors="replace")
    template = _json(path).get("chat_template")
    if isinstance(template, list):  # named templates
        return " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
