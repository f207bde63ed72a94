"""benchmarks/media_load.py plumbing at its smallest: distinct photo-sized JPEGs, and the
worker pool measured alone (no model, no HTTP)."""

from __future__ import annotations

import argparse
import base64
import io
from types import ModuleType

from PIL import Image

from support import import_benchmark


def load() -> ModuleType:
    return import_benchmark("media_load.py")


def test_the_flood_images_are_distinct_1280x960_jpegs() -> None:
    urls = load().photos(3)
    assert len(set(urls)) == 3
    data = base64.b64decode(urls[0].split(",", 1)[1])
    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.size) == ("JPEG", (1280, 960))


def test_pool_only_reports_images_per_second_for_each_worker_count() -> None:
    bench = load()
    args = argparse.Namespace(media_workers=[0, 1], images=4, seed=0)
    results = bench.pool_only(args)
    assert [r["server"] for r in results] == ["pool-w0", "pool-w1"]
    assert all(r["images"] == 4 and r["images_per_s"] > 0 for r in results)
