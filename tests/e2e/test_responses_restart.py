"""A background response survives kill -9 and a restart with SQLite persistence."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from support import ServerProcess

pytestmark = pytest.mark.slow
CREATE = {
    "model": "tiny",
    "input": "Write a long story about the sea.",
    "temperature": 0,
    "max_output_tokens": 200,
    "extra_body": {"ignore_eos": True},
}


def start(tiny_dir: Path, env: dict[str, str]) -> tuple[ServerProcess, openai.OpenAI]:
    args = ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"]
    server = ServerProcess(args, env)
    server.wait_ready()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return server, client


def finished(
    client: openai.OpenAI, response_id: str, timeout: float = 120
) -> openai.types.responses.Response:
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the response never finished"
        time.sleep(0.1)
    return response


def test_kill_9_during_a_background_response_then_retrieve_finishes_it(
    tiny_dir: Path, tmp_path: Path
) -> None:
    env = {"VLMSERVE_PERSIST_SESSIONS": "1", "VLMSERVE_SESSIONS_DB_PATH": str(tmp_path / "s.db")}
    server, client = start(tiny_dir, env)
    try:
        reference = finished(client, client.responses.create(**CREATE, background=True).id)
        started = client.responses.create(**CREATE, background=True)
        while len(client.responses.retrieve(started.id).output_text) < 20:
            time.sleep(0.02)  # some of it generated and stored
        server.proc.kill()  # kill -9: no clean shutdown
        server.proc.wait()
        server.stop()
        server, client = start(tiny_dir, env)
        killed_at = client.responses.retrieve(started.id)  # continued here from now on
        assert killed_at.status == "in_progress"
        assert len(killed_at.output_text) < len(reference.output_text)
        done = finished(client, started.id)
        assert done.status == reference.status == "incomplete"
        assert done.output_text == reference.output_text
        everything = list(client.responses.retrieve(started.id, stream=True))
        later = list(client.responses.retrieve(started.id, stream=True, starting_after=10))
    finally:
        server.stop()
    assert [e.sequence_number for e in everything] == list(range(len(everything)))
    assert [e.model_dump() for e in later] == [e.model_dump() for e in everything[11:]]
    deltas = "".join(e.delta for e in everything if e.type == "response.output_text.delta")
    assert deltas == reference.output_text
