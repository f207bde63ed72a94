"""``vlmserve tag``: caption, keyword and describe a folder of images and videos.

No torch here: the tagger is a client of any OpenAI-compatible server (a vlmserve resolves
``role:<role>`` model names). Pieces: ``files`` (walk, sha256, data URLs), ``client``
(httpx, bounded concurrency, retries, model choice by role), ``outputs`` (sidecar JSON,
``tags.jsonl``, XMP; resume by sha256), ``runner`` (the run and its summary).
"""

from __future__ import annotations

from vlmserve.tagger.client import RequestFailed, TagClient
from vlmserve.tagger.files import MediaFile, find_media
from vlmserve.tagger.outputs import OUTPUTS, TagRecord, make_writer
from vlmserve.tagger.runner import Outcome, Summary, TagOptions, resolve_models, run_tagging

__all__ = [
    "OUTPUTS",
    "MediaFile",
    "Outcome",
    "RequestFailed",
    "Summary",
    "TagClient",
    "TagOptions",
    "TagRecord",
    "find_media",
    "make_writer",
    "resolve_models",
    "run_tagging",
]
