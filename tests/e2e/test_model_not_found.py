"""A model that cannot be had fails a real ``vlmserve serve`` in seconds, saying what to do.

The hub is made unreachable on purpose (``HF_ENDPOINT`` on a closed loopback port, or
``HF_HUB_OFFLINE=1``) with an empty hub cache; before the fix transformers read a missing
directory as a repo id and retried the unreachable hub for minutes.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from support import ServerProcess, free_port

pytestmark = pytest.mark.slow
LIMIT_S = 30


def _hub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "HF_HOME": str(tmp_path / "hf"),  # an empty cache: nothing to fall back on
        "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "HF_HUB_ETAG_TIMEOUT": "3",
        "HF_HUB_DOWNLOAD_TIMEOUT": "3",
        "COLUMNS": "200",  # fewer line breaks in the error
        **extra,
    }


def _exit_within_limit(args: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    started = time.monotonic()
    server = ServerProcess(["serve", *args, "--device", "cpu"], env=env)
    try:
        server.proc.wait(timeout=LIMIT_S)
    finally:
        elapsed = time.monotonic() - started
        out = server.stop()
    return server.proc.returncode, " ".join(out.split()), elapsed


def test_a_missing_directory_is_named_and_start_up_exits_at_once(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-model"
    code, out, elapsed = _exit_within_limit(["--model", str(missing)], _hub_env(tmp_path))
    assert code == 1, out
    assert f"model directory '{missing}' does not exist" in out
    assert "Repo id must be" not in out
    assert elapsed < LIMIT_S


def test_an_unreachable_hub_says_how_to_use_a_local_directory(tmp_path: Path) -> None:
    repo = "nosuchorg/nosuch-model"
    code, out, elapsed = _exit_within_limit(["--model", repo], _hub_env(tmp_path))
    assert code == 1, out
    assert f"cannot reach the model hub to get model '{repo}'" in out
    assert f"hf download {repo} --local-dir DIR" in out and "--model DIR" in out
    assert "error: model 'nosuch-model' failed to load" in out  # the CLI's last word
    assert "Retrying" not in out
    assert elapsed < LIMIT_S


def test_a_cached_hub_model_loads_at_once_while_the_hub_is_unreachable(
    tmp_path: Path, tiny_dir: Path
) -> None:
    revision = "0" * 40
    repo_dir = tmp_path / "hf" / "hub" / "models--tinyorg--tiny-qwen2-vl"
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    for file in tiny_dir.iterdir():
        (snapshot / file.name).symlink_to(file)
    args = ["serve", "--model", "tinyorg/tiny-qwen2-vl", "--device", "cpu"]
    server = ServerProcess(args, env=_hub_env(tmp_path))
    try:
        server.wait_ready(timeout=90)  # loading is slow on a busy CPU; retries would be minutes
    finally:
        out = server.stop()
    assert "loading tinyorg/tiny-qwen2-vl from the cache" in " ".join(out.split())
    assert "Retrying" not in out and "thrown while requesting" not in out


def test_offline_on_demand_load_reports_the_reason_in_health_and_the_503(
    tmp_path: Path,
) -> None:
    repo = "nosuchorg/nosuch-model"
    env = _hub_env(tmp_path, HF_HUB_OFFLINE="1")
    server = ServerProcess(["serve", "--model", repo, "--device", "cpu", "--lazy-load"], env=env)
    try:
        server.wait_ready(timeout=LIMIT_S)
        body = {"model": "nosuch-model", "messages": [{"role": "user", "content": "hi"}]}
        started = time.monotonic()
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=LIMIT_S)
        elapsed = time.monotonic() - started
        health = httpx.get(f"{server.url}/health", timeout=5).json()
    finally:
        server.stop()
    assert reply.status_code == 503 and "retry-after" in reply.headers
    message = reply.json()["error"]["message"]
    assert "cannot reach the model hub" in message and "HF_HUB_OFFLINE=1" in message
    assert f"hf download {repo} --local-dir DIR" in message
    assert health["modelReady"] is False
    assert "cannot reach the model hub" in health["error"]
    assert elapsed < LIMIT_S
