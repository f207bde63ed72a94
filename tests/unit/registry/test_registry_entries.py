"""ModelEntry: what a registry file may say, and what it maps to in the engine."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from vlmserve.errors import ConfigError
from vlmserve.registry.entries import ModelEntry, VersionLock, aggregate_digest

DIGEST = "a" * 64


def entry(**fields: object) -> ModelEntry:
    return ModelEntry.model_validate({"name": "m", "source": "/models/m", **fields})


def test_defaults_serve_under_the_name_with_chat_role_and_vision() -> None:
    e = entry()
    assert (e.backend, e.served_id, e.roles, e.deprecated) == ("hf", "m", ["chat"], False)
    assert e.capabilities.enabled() == ["vision"]
    assert e.keep_alive is None and e.version_lock is None


def test_identifiers_are_name_served_id_and_aliases_without_repeats() -> None:
    e = entry(served_model_id="m-served", model_aliases=["old", "older"])
    assert e.identifiers == ["m", "m-served", "old", "older"]
    assert entry(served_model_id="m").identifiers == ["m"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"roles": ["Caption"]}, "lowercase identifier"),
        ({"roles": ["caption", "caption"]}, "more than once"),
        ({"model_aliases": ["x", "x"]}, "more than once"),
        ({"model_aliases": ["m"]}, "repeat the entry's name"),
        ({"served_model_id": "s", "model_aliases": ["s"]}, "repeat the entry's name"),
        ({"model_aliases": ["role:chat"]}, "reserved for roles"),
        ({"name": " m"}, "leading or trailing spaces"),
        ({"source": None}, "needs `source`"),
        ({"roles": ["embedding"]}, "capabilities.embedding = true"),
        ({"keep_alive": -5}, "-1 to never unload"),
        ({"limits": {"max_pixels": 0}}, "greater than 0"),
        ({"capabilities": {"audio": True}}, "Extra inputs"),
        ({"sourse": "typo"}, "Extra inputs"),
        ({"backend": "ollama"}, "'hf', 'openai' or 'vllm'"),
    ],
)
def test_invalid_entries_are_rejected_with_a_reason(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        entry(**fields)


def test_openai_entry_needs_no_source_but_has_no_engine_config() -> None:
    e = ModelEntry(name="up", backend="openai", backend_config={"base_url": "http://h:8000/v1"})
    with pytest.raises(ConfigError, match="only hf entries"):
        e.to_model_config()


def test_to_model_config_serves_the_served_id_with_adapter_and_roles() -> None:
    e = entry(
        served_model_id="vlm2vec",
        adapter="TIGER-Lab/VLM2Vec-Qwen2VL-2B",
        roles=["embedding"],
        capabilities={"embedding": True},
    )
    cfg = e.to_model_config(device="cpu")
    assert (cfg.served_name, cfg.source, cfg.adapter) == (
        "vlm2vec",
        "/models/m",
        "TIGER-Lab/VLM2Vec-Qwen2VL-2B",
    )
    assert (cfg.roles, cfg.device, cfg.dtype) == (["embedding"], "cpu", None)


def test_aggregate_is_sha256_over_sorted_sha256sum_lines() -> None:
    files = {"b.bin": "b" * 64, "a/c.json": "c" * 64}
    lines = f"{'c' * 64}  a/c.json\n{'b' * 64}  b.bin\n"
    assert aggregate_digest(files) == hashlib.sha256(lines.encode()).hexdigest()


def test_version_lock_with_a_hand_edited_aggregate_is_rejected() -> None:
    files = {"w.bin": DIGEST}
    VersionLock(files=files, aggregate_sha256=aggregate_digest(files), locked_at="t")
    with pytest.raises(ValidationError, match="does not match the file hashes"):
        VersionLock(files=files, aggregate_sha256="0" * 64, locked_at="t")


@pytest.mark.parametrize("path", ["/abs.bin", "../up.bin", "a//b", "a\\b", "./a"])
def test_version_lock_paths_stay_inside_the_model(path: str) -> None:
    files = {path: DIGEST}
    with pytest.raises(ValidationError, match="relative POSIX path"):
        VersionLock(files=files, aggregate_sha256=aggregate_digest(files), locked_at="t")
