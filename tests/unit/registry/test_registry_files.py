"""Layered registry files: merge, resolution, conflicts, snapshots and TOML write-back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vlmserve.errors import ConfigError, NotFound
from vlmserve.registry.entries import ModelEntry, VersionLock, aggregate_digest
from vlmserve.registry.files import (
    Registry,
    dumps_toml,
    load_registry,
    read_entries,
    write_locks,
    write_snapshot,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CURATED = """\
# curated registry
[[models]]
name = "qwen-7b"          # the big one
source = "/models/qwen-7b"
served_model_id = "qwen2-vl-7b"
roles = ["chat", "caption"]
model_aliases = ["Qwen2-VL-7B-Instruct"]

[models.capabilities]
video = true

# --- the old caption model ---
[[models]]
name = "qwen-2b"
source = "/models/qwen-2b"
roles = ["caption", "keywords"]
deprecated = true
"""

DISCOVERED = {
    "models": [
        {"name": "zeta", "source": "/found/zeta", "roles": ["keywords"]},
        {"name": "qwen-7b", "source": "/found/elsewhere", "roles": ["ocr"]},
        {"name": "alpha", "source": "/found/alpha", "roles": ["ocr"], "model_aliases": ["a"]},
    ]
}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    curated = tmp_path / "registry.toml"
    curated.write_text(CURATED)
    discovered = tmp_path / "discovered.json"
    discovered.write_text(json.dumps(DISCOVERED))
    return curated, discovered


def make(*entries: dict) -> Registry:
    return Registry(ModelEntry.model_validate({"source": "/m", **e}) for e in entries)


def test_curated_entry_replaces_the_discovered_one_whole(files: tuple[Path, Path]) -> None:
    registry = load_registry(*files)
    qwen = registry.get("qwen-7b")
    assert qwen is not None
    assert (qwen.source, qwen.roles) == ("/models/qwen-7b", ["chat", "caption"])
    assert registry.origin("qwen-7b") == "curated" and registry.origin("zeta") == "discovered"


def test_merged_order_is_curated_file_order_then_discovered_by_name(
    files: tuple[Path, Path],
) -> None:
    assert load_registry(*files).names == ["qwen-7b", "qwen-2b", "alpha", "zeta"]


def test_missing_discovered_file_counts_as_empty(files: tuple[Path, Path], tmp_path: Path) -> None:
    assert load_registry(files[0], tmp_path / "not-yet.json").names == ["qwen-7b", "qwen-2b"]


def test_snapshot_is_sorted_and_byte_identical_across_runs(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    first, second, shuffled = tmp_path / "1.json", tmp_path / "2.json", tmp_path / "3.json"
    write_snapshot(load_registry(*files), first)
    write_snapshot(load_registry(*files), second)
    reordered = tmp_path / "reordered.json"
    reordered.write_text(json.dumps({"models": DISCOVERED["models"][::-1]}, indent=4))
    write_snapshot(load_registry(files[0], reordered), shuffled)
    assert first.read_bytes() == second.read_bytes() == shuffled.read_bytes()
    models = json.loads(first.read_text())["models"]
    names = [m["name"] for m in models]
    assert names == ["alpha", "qwen-2b", "qwen-7b", "zeta"]
    assert list(models[0]) == sorted(models[0])  # keys sorted too
    assert [e.name for e in read_entries(first)] == names  # a snapshot is itself a registry


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("qwen-7b", "qwen-7b"),  # name
        ("Qwen2-VL-7B-Instruct", "qwen-7b"),  # alias
        ("qwen2-vl-7b", "qwen-7b"),  # served id
        ("a", "alpha"),  # alias from the discovered layer
        ("role:caption", "qwen-7b"),
        ("role:keywords", "zeta"),  # qwen-2b is first but deprecated
        ("role:ocr", "alpha"),  # discovered entries by name (qwen-7b's ocr was replaced)
        ("qwen-2b", "qwen-2b"),  # deprecated still resolves by name
    ],
)
def test_resolve_by_name_alias_served_id_and_role(
    files: tuple[Path, Path], query: str, name: str
) -> None:
    assert load_registry(*files).resolve(query).name == name


def test_role_held_only_by_deprecated_entries_is_not_found_and_says_so() -> None:
    registry = make({"name": "old", "roles": ["caption"], "deprecated": True})
    assert registry.resolve("old").deprecated
    with pytest.raises(NotFound, match="only by deprecated models \\(old\\)"):
        registry.resolve("role:caption")


def test_unknown_model_is_not_found_listing_what_is_available(files: tuple[Path, Path]) -> None:
    with pytest.raises(NotFound) as caught:
        load_registry(*files).resolve("gpt-4o")
    message = caught.value.message
    assert "'gpt-4o' is not in the registry" in message
    assert "available: qwen-7b, alpha, zeta (deprecated: qwen-2b)" in message
    assert "role:caption" in message
    assert caught.value.status_code == 404 and caught.value.param == "model"


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (
            {"name": "b", "model_aliases": ["a"]},
            "alias 'a' of entry 'b' is also the name of entry 'a'",
        ),
        (
            {"name": "b", "model_aliases": ["x"]},
            "alias 'x' of entry 'b' is also the alias of entry 'a'",
        ),
        (
            {"name": "b", "served_model_id": "a-served"},
            "served_model_id 'a-served' of entry 'b' is also the served_model_id of entry 'a'",
        ),
        (
            {"name": "b", "served_model_id": "x"},
            "alias 'x' of entry 'a' is also the served_model_id of entry 'b'",
        ),
        ({"name": "a"}, "two registry entries are named 'a'"),
    ],
)
def test_identifier_claimed_by_two_entries_is_a_config_error(second: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make({"name": "a", "served_model_id": "a-served", "model_aliases": ["x"]}, second)


def test_discovered_alias_equal_to_a_curated_name_is_a_conflict(tmp_path: Path) -> None:
    curated, discovered = tmp_path / "c.toml", tmp_path / "d.json"
    curated.write_text('[[models]]\nname = "a"\nsource = "/a"\n')
    discovered.write_text(
        json.dumps({"models": [{"name": "b", "source": "/b", "model_aliases": ["a"]}]})
    )
    with pytest.raises(ConfigError, match="entry 'b' is also the name of entry 'a'"):
        load_registry(curated, discovered)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("r.toml", "[[models]]\nname = \n", "not valid TOML"),
        ("r.json", "{", "not valid JSON"),
        ("r.yaml", "models: []", "must end in .toml or .json"),
        ("r.toml", "model = []\n", "unknown top-level keys \\['model'\\]"),
        ("r.toml", '[[models]]\nname = "a"\n', "models\\[0\\] \\(a\\): entry: an hf entry needs"),
        (
            "r.toml",
            '[[models]]\nname = "a"\nsource = "/a"\nroles = ["X"]\n',
            "roles: role 'X' must be a lowercase",
        ),
        (
            "r.json",
            '{"models": [{"name": "a", "source": "/a"}, {"name": "a", "source": "/b"}]}',
            "names 'a' twice",
        ),
    ],
)
def test_bad_registry_files_are_config_errors_naming_file_and_entry(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_registry(path)


def test_missing_curated_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_registry(tmp_path / "registry.toml")


def test_dumps_toml_round_trips_the_registry_schema() -> None:
    doc = {
        "models": [
            {
                "name": 'we"ird\\ \u00e9 \x7f \n',
                "keep_alive": -1.0,
                "roles": ["a", "b"],
                "deprecated": False,
                "limits": {"max_pixels": 1003520},
                "backend_config": {"port": 8000, "command": ["vllm", "serve"], "env": {}},
                "version_lock": {"files": {"sub dir/w.bin": "0" * 64}, "locked_at": "t"},
            },
            {"name": "b", "backend_config": {"nested": {"deep": {"x": 1.5}}, "mix": [{"a": 1}]}},
        ]
    }
    text = dumps_toml(doc)
    assert tomllib.loads(text) == doc
    assert dumps_toml(tomllib.loads(text)) == text


def lock_of(digest: str) -> VersionLock:
    files = {"model.safetensors": digest * 64}
    return VersionLock(files=files, aggregate_sha256=aggregate_digest(files), locked_at="now")


def test_write_locks_edits_toml_in_place_keeping_comments_and_order(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(CURATED)
    assert write_locks(path, {"qwen-7b": lock_of("1")}) is True
    text = path.read_text()
    for comment in ("# curated registry", "# the big one", "# --- the old caption model ---"):
        assert comment in text
    assert text.index("[models.version_lock]") < text.index("# --- the old caption model ---")
    entries = read_entries(path)
    assert [e.name for e in entries] == ["qwen-7b", "qwen-2b"]
    assert entries[0].version_lock == lock_of("1") and entries[1].version_lock is None
    assert entries[0].capabilities.video  # the other tables of the entry survive

    assert write_locks(path, {"qwen-7b": lock_of("2"), "qwen-2b": lock_of("3")}) is True
    again = path.read_text()
    assert again.count("[models.version_lock]") == 2 and "1" * 64 not in again
    assert [e.version_lock for e in read_entries(path)] == [lock_of("2"), lock_of("3")]
    write_locks(path, {"qwen-7b": lock_of("2"), "qwen-2b": lock_of("3")})
    assert path.read_text() == again  # idempotent: no blank lines pile up


def test_write_locks_replaces_a_lock_between_tables_keeping_the_comments(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(CURATED)
    write_locks(path, {"qwen-2b": lock_of("1")})
    text = path.read_text().replace(
        "\n[models.version_lock]", "\n[models.version_lock] # pinned\n# why: audited"
    )
    path.write_text(text + "\n# the limits follow\n[models.limits]\nmax_tokens = 64\n")
    write_locks(path, {"qwen-2b": lock_of("2")})
    text = path.read_text()
    assert "# the limits follow\n[models.limits]" in text
    assert "# pinned" not in text and "# why: audited" not in text  # the old lock's own lines go
    entry = read_entries(path)[1]
    assert entry.version_lock == lock_of("2") and entry.limits.max_tokens == 64


def test_write_locks_rewrites_whole_toml_when_it_cannot_edit_in_place(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_text('models = [{ name = "a", source = "/a" }, { name = "b", source = "/b" }]\n')
    assert write_locks(path, {"b": lock_of("4")}) is False
    assert [(e.name, e.version_lock) for e in read_entries(path)] == [
        ("a", None),
        ("b", lock_of("4")),
    ]


def test_write_locks_in_json_keeps_key_order(tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"models": [{"source": "/a", "name": "a"}]}))
    write_locks(path, {"a": lock_of("5")})
    assert list(json.loads(path.read_text())["models"][0]) == ["source", "name", "version_lock"]


def test_write_locks_refuses_entries_outside_the_curated_file(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(CURATED)
    with pytest.raises(ConfigError, match="zeta not in the curated file"):
        write_locks(path, {"zeta": lock_of("6")})
    assert path.read_text() == CURATED


def test_the_example_registry_in_deploy_loads_and_resolves() -> None:
    example = Path(__file__).parents[3] / "deploy" / "registry.example.toml"
    registry = load_registry(example)
    assert registry.resolve("role:caption").name == "qwen2-vl-7b-instruct"
    assert registry.resolve("role:embedding").adapter == "TIGER-Lab/VLM2Vec-Qwen2VL-2B"
    assert registry.resolve("qwen2-vl-2b").deprecated
