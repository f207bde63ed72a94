"""Decode attention that reads the paged cache in place, and the step CUDA graphs capture.

The Triton kernels run here on Triton's CPU interpreter (in a subprocess: the interpreter
is chosen when the kernels are defined); on a GPU, ``tests/gpu`` runs them for real and
compares CUDA-graph replays with eager steps.

Pinned: the paged kernel equals attention over the gathered blocks for rows that end
mid-block, on a block boundary, at one key and across several splits, with grouped-query
heads; the tiny Qwen2-VL's decode step through ``PagedDecode`` (the batch alone, and padded
to a larger bucket as a graph replays it) gives the gathered step's logits and never
gathers; buckets and splits are chosen as documented.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmserve.engine.models.graphs import BUCKETS, bucket_for
from vlmserve.engine.models.paged_attention import MAX_SPLITS, splits_for

CHECK = Path(__file__).with_name("paged_check.py")
pytest.importorskip("triton", reason="the paged kernels are Triton's")


def check(*args: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_paged_kernel_equals_attention_over_gathered_blocks() -> None:
    got = check("kernel")
    assert got["splits"] > 1  # the 600-key row spans several splits
    assert got["torch.float32"] < 1e-5
    assert got["torch.float16"] < 2e-3


def test_a_paged_decode_step_equals_the_gathered_one_alone_and_padded(tiny_dir: Path) -> None:
    got = check("runner", str(tiny_dir))
    assert got["alone"] < 1e-4 and got["padded"] < 1e-4
    assert got["argmax_equal"]
    assert got["buckets"] == [1, 2, 4, 8]


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it() -> None:
    assert [bucket_for(n, BUCKETS) for n in (1, 3, 8, 9, 33, 256)] == [1, 4, 8, 16, 48, 256]
    assert bucket_for(257, BUCKETS) is None


def test_splits_read_at_least_256_keys_and_are_bounded_in_number() -> None:
    assert splits_for(1, 16) == (1, 16)
    assert splits_for(64, 16) == (4, 16)  # 1,024 keys: 4 splits of 256
    splits, per = splits_for(10_000, 16)  # 160k keys
    assert splits <= MAX_SPLITS and splits * per >= 10_000
