"""Version locks: hashing a model directory, and drift found by ``verify``."""

from __future__ import annotations

import hashlib
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest

from vlmserve.errors import ConfigError
from vlmserve.registry.entries import ModelEntry, VersionLock, aggregate_digest
from vlmserve.registry.lock import CHUNK, Drift, DriftKind, hash_artifacts, verify

WEIGHTS = "model.safetensors"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_dir(root: Path) -> Path:
    files = {
        "config.json": b"{}",
        "sub/shard-00001.bin": b"w" * 10,
        ".cache/hf/x": b"cache",
        ".gitattributes": b"*",
        "sub/.hidden": b"h",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def locked(path: Path) -> tuple[ModelEntry, VersionLock]:
    lock = hash_artifacts(path)
    return ModelEntry(name="m", source=str(path), version_lock=lock), lock


def test_lock_hashes_every_visible_file_by_relative_posix_path(tmp_path: Path) -> None:
    lock = hash_artifacts(
        model_dir(tmp_path), now=datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    )
    assert lock.files == {"config.json": sha(b"{}"), "sub/shard-00001.bin": sha(b"w" * 10)}
    listing = f"{sha(b'{}')}  config.json\n{sha(b'w' * 10)}  sub/shard-00001.bin\n"
    assert lock.aggregate_sha256 == sha(listing.encode())  # `sha256sum` lines, sorted by path
    assert lock.locked_at == "2025-01-02T03:04:05Z"


def test_lock_does_not_depend_on_where_the_directory_is(tmp_path: Path) -> None:
    first = hash_artifacts(model_dir(tmp_path / "a"))
    second = hash_artifacts(model_dir(tmp_path / "elsewhere" / "b"))
    assert (first.files, first.aggregate_sha256) == (second.files, second.aggregate_sha256)


def test_lock_streams_large_files_in_chunks_reporting_progress(tmp_path: Path) -> None:
    (tmp_path / "big.bin").write_bytes(b"\0" * (2 * CHUNK + 5))
    seen: list[int] = []
    lock = hash_artifacts(tmp_path, seen.append)
    assert seen == [CHUNK, CHUNK, 5]
    assert lock.files["big.bin"] == sha(b"\0" * (2 * CHUNK + 5))


def test_hub_repo_id_cannot_be_locked_until_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    files = {"w": "0" * 64}
    lock = {"files": files, "aggregate_sha256": aggregate_digest(files), "locked_at": "t"}
    entry = ModelEntry(name="q", source="Qwen/Qwen2-VL-2B-Instruct", version_lock=lock)
    with pytest.raises(ConfigError, match="download it and point source at the directory"):
        verify(entry)
    with pytest.raises(ConfigError, match="is not a directory"):
        hash_artifacts(Path("Qwen/Qwen2-VL-2B-Instruct"))


def test_verify_without_lock_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run `vlmserve registry lock m`"):
        verify(ModelEntry(name="m", source=str(tmp_path)))


def test_verify_passes_on_the_locked_tiny_checkpoint(tiny_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_dir, tmp_path / "tiny"))
    entry, lock = locked(copy)
    assert WEIGHTS in lock.files
    assert not any(name.startswith(".") for name in lock.files)  # the build marker is skipped
    assert verify(entry) == []


def test_one_flipped_weight_byte_is_drift_naming_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_dir, tmp_path / "tiny"))
    entry, lock = locked(copy)
    weights = copy / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    assert verify(entry) == [
        Drift(WEIGHTS, DriftKind.CHANGED, lock.files[WEIGHTS], sha(bytes(data)))
    ]


def test_added_and_removed_files_are_drift(tmp_path: Path) -> None:
    root = model_dir(tmp_path / "m")
    entry, _ = locked(root)
    (root / "config.json").unlink()
    (root / "sub" / "extra.bin").write_bytes(b"new")
    (root / ".cache" / "ignored").write_bytes(b"not an artifact")
    drifts = verify(entry)
    assert [(d.kind, d.path) for d in drifts] == [
        (DriftKind.MISSING, "config.json"),
        (DriftKind.ADDED, "sub/extra.bin"),
    ]
    assert drifts[0].actual is None and drifts[1].expected is None
    assert str(drifts[1]) == f"added: sub/extra.bin (expected None, actual {sha(b'new')})"
