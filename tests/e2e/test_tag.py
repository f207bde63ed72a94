"""`vlmserve tag` end to end: a real server (uvicorn, tiny model), a folder of 20 images and
one corrupt file; sidecars written, the next run skips them all, --force redoes them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from support import LiveServer
from vlmserve.cli.main import app
from vlmserve.testing.media import image_bytes

KEYS = {"file", "sha256", "caption", "keywords", "description", "model", "tagged_at"}


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    for i in range(20):
        fmt = "PNG" if i % 2 else "JPEG"
        (tmp_path / f"img{i:02d}.{fmt.lower()}").write_bytes(image_bytes(64, 48, fmt, seed=i))
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00garbage" * 20)
    (tmp_path / "notes.txt").write_text("not media")
    return tmp_path


def tag(server: LiveServer, folder: Path, *extra: str) -> tuple[int, str]:
    args = [
        "tag",
        str(folder),
        "--server",
        server.url,
        "--max-tokens",
        "16",
        "--concurrency",
        "8",
        *extra,
    ]
    result = CliRunner().invoke(app, args)
    return result.exit_code, result.output + (result.stderr or "")


def count(output: str, status: str) -> int:
    match = re.search(rf"{status}\s*│\s*(\d+)", output)
    assert match, output
    return int(match.group(1))


def sidecars(folder: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def test_tag_writes_sidecars_resumes_and_redoes_with_force(
    live_server: Callable[..., LiveServer], photos: Path
) -> None:
    server = live_server()
    code, output = tag(server, photos)
    assert code == 1, output  # the corrupt file failed; the run went on
    assert (count(output, "done"), count(output, "skipped"), count(output, "failed")) == (20, 0, 1)
    assert "broken.jpg" in output and "not a readable image" in output
    first = sidecars(photos)
    assert len(first) == 20 and "broken.jpg.json" not in first
    for name, data in first.items():
        assert set(data) >= KEYS
        assert data["file"] == name.removesuffix(".json")
        assert data["model"] == "tiny"
        assert isinstance(data["keywords"], list) and isinstance(data["caption"], str)

    stamp = "2000-01-01T00:00:00+00:00"  # marks every sidecar: a skip must leave it there
    for name, data in first.items():
        (photos / name).write_text(json.dumps({**data, "tagged_at": stamp}))

    code, output = tag(server, photos, "--skip-preflight")
    assert code == 1, output
    assert (count(output, "done"), count(output, "skipped"), count(output, "failed")) == (0, 20, 1)
    assert all(data["tagged_at"] == stamp for data in sidecars(photos).values())

    code, output = tag(server, photos, "--skip-preflight", "--force")
    assert code == 1, output
    assert (count(output, "done"), count(output, "skipped"), count(output, "failed")) == (20, 0, 1)
    again = sidecars(photos)
    assert all(again[n]["tagged_at"] != stamp for n in first)
    assert all(again[n]["sha256"] == first[n]["sha256"] for n in first)


def test_tag_to_xmp_and_jsonl(live_server: Callable[..., LiveServer], tmp_path: Path) -> None:
    server = live_server()
    for i in range(2):
        (tmp_path / f"p{i}.png").write_bytes(image_bytes(32, 32, seed=i))
    code, output = tag(server, tmp_path, "--skip-preflight", "--out", "xmp")
    assert code == 0, output
    assert sorted(p.name for p in tmp_path.glob("*.xmp")) == ["p0.png.xmp", "p1.png.xmp"]
    code, output = tag(server, tmp_path, "--skip-preflight", "--out", "jsonl")
    assert code == 0, output
    lines = (tmp_path / "tags.jsonl").read_text().splitlines()
    assert [json.loads(line)["file"] for line in lines] == ["p0.png", "p1.png"]


def test_an_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["tag", str(tmp_path), "--server", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "cannot connect" in result.output + (result.stderr or "")
