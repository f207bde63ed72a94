"""The one fixture the GPU tests need, so that they also run alone on a GPU machine.

There, ``pytest tests/gpu --confcutdir tests/gpu`` skips the root conftest, whose server
fixtures import FastAPI, Redis and the rest of the serving stack; the engine needs only
torch, transformers and vlmserve's own core dependencies (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmserve.testing import build_qwen2_vl


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return build_qwen2_vl()
