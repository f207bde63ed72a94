"""Tagger pieces without a server: the walk, encoding, the three output formats, resume."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vlmserve.tagger import TagRecord, find_media, make_writer
from vlmserve.tagger.files import encode_media, sha256_of
from vlmserve.tagger.outputs import NS, JsonlWriter
from vlmserve.testing.media import image_bytes, mp4_bytes


def record(rel: str = "a.png", sha: str = "abc", **kw: object) -> TagRecord:
    base = dict(
        file=rel,
        sha256=sha,
        caption="A dog.",
        keywords=["dog", "beach & sea"],
        description="A dog <runs> on a beach.",
        model="tiny",
        tagged_at="2025-01-01T00:00:00+00:00",
    )
    return TagRecord(**{**base, **kw})  # type: ignore[arg-type]


def test_the_walk_finds_images_and_videos_recursively_and_skips_the_rest(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    for name in (
        "a.PNG",
        "sub/b.jpg",
        "c.mp4",
        "notes.txt",
        "a.PNG.json",
        ".hidden/d.png",
        ".e.png",
    ):
        (tmp_path / name).write_bytes(b"x")
    found = find_media(tmp_path)
    assert [(m.rel, m.kind) for m in found] == [
        ("a.PNG", "image"),
        ("c.mp4", "video"),
        ("sub/b.jpg", "image"),
    ]


def test_images_are_sent_downscaled_as_jpeg_and_videos_as_they_are(tmp_path: Path) -> None:
    (tmp_path / "big.png").write_bytes(image_bytes(2000, 1000))
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes(frames=2))
    image, video = sorted(find_media(tmp_path), key=lambda m: m.kind)
    part = encode_media(image, image.path.read_bytes())
    assert part["image_url"]["url"].startswith("data:image/jpeg;base64,")  # type: ignore[index]
    clip = encode_media(video, video.path.read_bytes())
    assert clip["video_url"]["url"].startswith("data:video/mp4;base64,")  # type: ignore[index]


def test_a_corrupt_image_is_refused_with_a_reason(tmp_path: Path) -> None:
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (media,) = find_media(tmp_path)
    with pytest.raises(ValueError, match="not a readable image"):
        encode_media(media, media.path.read_bytes())


def test_a_sidecar_holds_the_record_and_resumes_by_sha256(tmp_path: Path) -> None:
    writer = make_writer("sidecar", tmp_path)
    assert not writer.done("a.png", "abc")
    writer.write(record())
    data = json.loads((tmp_path / "a.png.json").read_text())
    assert {"file", "sha256", "caption", "keywords", "description", "model", "tagged_at"} <= set(
        data
    )
    assert writer.done("a.png", "abc")
    assert not writer.done("a.png", "changed")  # the image changed: tag it again
    (tmp_path / "a.png.json").write_text("{torn")
    assert not writer.done("a.png", "abc")


def test_jsonl_keeps_one_line_per_file_and_survives_a_torn_line(tmp_path: Path) -> None:
    writer = make_writer("jsonl", tmp_path)
    writer.write(record("a.png", "1"))
    writer.write(record("b.png", "2"))
    writer.write(record("a.png", "3"))  # --force: a newer answer
    writer.finish()
    with (tmp_path / JsonlWriter.NAME).open("a") as out:
        out.write('{"file": "c.png", "sha')  # an interrupted run
    again = make_writer("jsonl", tmp_path)
    assert again.done("a.png", "3") and again.done("b.png", "2")
    assert not again.done("a.png", "1") and not again.done("c.png", "x")
    again.finish()
    lines = (tmp_path / JsonlWriter.NAME).read_text().splitlines()
    assert [json.loads(line)["file"] for line in lines] == ["a.png", "b.png"]


def test_xmp_is_valid_xml_with_description_and_a_subject_bag(tmp_path: Path) -> None:
    writer = make_writer("xmp", tmp_path)
    writer.write(record())
    root = ET.parse(tmp_path / "a.png.xmp").getroot()
    rdf, dc = f"{{{NS['rdf']}}}", f"{{{NS['dc']}}}"
    bag = root.find(f".//{dc}subject/{rdf}Bag")
    assert bag is not None and [li.text for li in bag] == ["dog", "beach & sea"]
    desc = root.find(f".//{dc}description/{rdf}Alt/{rdf}li")
    assert desc is not None and desc.text == "A dog <runs> on a beach."
    title = root.find(f".//{dc}title/{rdf}Alt/{rdf}li")
    assert title is not None and title.text == "A dog."
    assert writer.done("a.png", "abc") and not writer.done("a.png", "other")


def test_an_unknown_output_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sidecar, jsonl, xmp"):
        make_writer("csv", tmp_path)


def test_sha256_is_of_the_file_bytes() -> None:
    assert sha256_of(b"abc").startswith("ba7816bf")
