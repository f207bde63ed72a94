"""openai-node (the official JavaScript SDK) against a real ``vlmserve serve`` process: it
parses answers that carry the per-request ``metrics`` object and vLLM's ``repetition`` finish
reason, JSON and streamed. ``scripts/setup.sh`` installs the SDK with npm."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support import ServerProcess
from vlmserve.testing.scripted import build_scripted

pytestmark = pytest.mark.slow

NODE_DIR = Path(os.environ.get("VLMSERVE_NODE_DIR", Path.home() / ".cache/vlmserve/node"))
LOOP = " Total: 12.50 EUR"  # the scripted model says this over and over
DETECT = {"max_pattern_size": 20, "min_pattern_size": 2, "min_count": 3}

SCRIPT = """
const { default: OpenAI } = require("openai");
const client = new OpenAI({ baseURL: process.env.BASE_URL + "/v1", apiKey: "unused" });
const body = {
  model: "loop",
  messages: [{ role: "user", content: "Read the receipt" }],
  max_tokens: 200,
  temperature: 0,
  repetition_detection: JSON.parse(process.env.DETECT),
  include_metrics: true,
};
(async () => {
  const answer = await client.chat.completions.create(body);
  const stream = await client.chat.completions.create({
    ...body, stream: true, stream_options: { include_usage: true },
  });
  let text = "", finish = null, usage = null, metrics = null;
  for await (const chunk of stream) {
    for (const choice of chunk.choices) {
      text += choice.delta.content || "";
      finish = choice.finish_reason || finish;
    }
    if (chunk.usage) { usage = chunk.usage; metrics = chunk.metrics || null; }
  }
  console.log(JSON.stringify({
    json: { text: answer.choices[0].message.content, finish: answer.choices[0].finish_reason,
            usage: answer.usage, metrics: answer.metrics || null },
    stream: { text, finish, usage, metrics },
  }));
})().catch((err) => { console.error(String(err)); process.exit(1); });
"""


@pytest.fixture(scope="module")
def node_sdk() -> Path:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        pytest.skip(f"the openai npm package is not in {NODE_DIR} (scripts/setup.sh installs it)")
    return NODE_DIR


@pytest.fixture(scope="module")
def loop_server() -> Iterator[ServerProcess]:
    model = build_scripted(LOOP, loop=True)
    process = ServerProcess(
        ["serve", "--model", str(model), "--served-model-name", "loop", "--device", "cpu"]
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def run_node(node_dir: Path, url: str) -> dict[str, Any]:
    env = {**os.environ, "BASE_URL": url, "DETECT": json.dumps(DETECT)}
    done = subprocess.run(
        ["node", "-e", SCRIPT], cwd=node_dir, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_openai_node_parses_the_repetition_finish_and_the_metrics(
    node_sdk: Path, loop_server: ServerProcess
) -> None:
    got = run_node(node_sdk, loop_server.url)
    for wire in ("json", "stream"):
        answer = got[wire]
        assert answer["finish"] == "repetition", answer
        assert answer["text"].count("12.50") == DETECT["min_count"], answer["text"]
        assert answer["usage"]["completion_tokens"] < 200
        metrics = answer["metrics"]
        assert metrics is not None, f"{wire}: no metrics object"
        assert metrics["time_to_first_token_ms"] >= 0 and metrics["e2e_ms"] > 0
    assert got["json"]["text"] == got["stream"]["text"]
