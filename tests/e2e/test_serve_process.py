"""The real CLI as a real process, driven by the official ``openai`` client and the manual."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI
from PIL import Image

from support import ServerProcess
from vlmserve.testing.media import data_url, gradient_image, image_bytes

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"],
        engine_process=True,  # the default
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def image_request(image: Image.Image) -> list[dict]:
    png = data_url(image_bytes(image.width, image.height), "image/png")
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png}},
                {"type": "text", "text": "Describe the image."},
            ],
        }
    ]


def test_openai_client_json_and_stream_agree(served: ServerProcess, tiny_dir: Path) -> None:
    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    image = gradient_image(64, 64)
    messages = image_request(image)
    params = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**params)
    stream = client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    )
    pieces, token_chunks, streamed_usage = [], 0, None
    for chunk in stream:
        if chunk.usage is not None:
            streamed_usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content is not None:  # the first carries the role with its token
                pieces.append(choice.delta.content)
                token_chunks += choice.finish_reason is None
    assert "".join(pieces) == full.choices[0].message.content
    assert streamed_usage is not None
    assert streamed_usage.completion_tokens == full.usage.completion_tokens == token_chunks
    assert (
        streamed_usage.prompt_tokens == full.usage.prompt_tokens == _prompt_tokens(tiny_dir, image)
    )


def test_the_api_process_never_loads_torch_when_the_engine_has_its_own(
    served: ServerProcess,
) -> None:
    """With the engine in its own process (the default), the API process renders, decodes
    media and streams without torch: it starts in a few seconds and holds about 100 MiB
    instead of the model code's 800."""
    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="tiny", messages=image_request(gradient_image(32, 32)), max_tokens=4
    )
    assert answer.choices[0].message.content is not None
    api = psutil.Process(served.proc.pid)
    engines = [p for p in api.children() if "vlmserve.engine.proc" in " ".join(p.cmdline())]
    assert engines, "no engine process under the server"
    assert "libtorch" in Path(f"/proc/{engines[0].pid}/maps").read_text()
    assert "libtorch" not in Path(f"/proc/{api.pid}/maps").read_text()


def _prompt_tokens(tiny_dir: Path, image: Image.Image) -> int:
    """What the model's own processor counts for the same conversation."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_dir)
    conversation = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}],
        }
    ]
    text = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=[image], return_tensors="pt")["input_ids"].shape[1]


def test_health_reports_the_model_id(served: ServerProcess) -> None:
    health = httpx.get(f"{served.url}/health").json()
    assert health == {**health, "ok": True, "modelReady": True, "modelId": "tiny", "error": None}


def test_missing_model_fails_start_up_with_a_clear_message(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    missing.mkdir()
    server = ServerProcess(["serve", "--model", str(missing), "--device", "cpu"])
    try:
        server.proc.wait(timeout=120)
    finally:
        out = server.stop()
    assert server.proc.returncode not in (0, None)
    assert str(missing) in out and "--model" in out


def _readme_curl() -> str:
    readme = (ROOT / "docs" / "getting-started.md").read_text()
    match = re.search(r"<!-- curl-example.*?-->\s*```bash\n(.*?)```", readme, re.S)
    assert match, "docs/getting-started.md lost its curl example"
    return match.group(1)


def test_readme_demo_and_curl_example_work() -> None:
    demo = ServerProcess(["demo"])
    try:
        demo.wait_ready()
        script = _readme_curl().replace("127.0.0.1:8000", f"127.0.0.1:{demo.port}")
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    finally:
        log = demo.stop()
    assert done.returncode == 0, done.stderr
    body = httpx.Response(200, content=done.stdout).json()
    assert body["object"] == "chat.completion", done.stdout
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert "RANDOM" in log


def test_mismatched_adapter_fails_start_up_naming_both_bases(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from vlmserve.testing import build_foreign_adapter

    foreign = build_foreign_adapter()
    config = tmp_path / "vlmserve.toml"
    config.write_text(
        'device = "cpu"\n\n[[models]]\nname = "emb"\n'
        f'source = "{tiny_dir}"\nadapter = "{foreign}"\nroles = ["embedding"]\n'
    )
    server = ServerProcess(["serve", "--config", str(config)])
    try:
        server.proc.wait(timeout=120)
    finally:
        out = server.stop()
    assert server.proc.returncode not in (0, None)
    assert "Phi-3.5-vision-instruct" in out and str(tiny_dir) in out


@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_the_engine_process_ends_with_the_server(tiny_dir: Path, how: str) -> None:
    """By default the real CLI answers through an engine process, which exits when
    the server stops (SIGTERM: the model unloads) or dies (SIGKILL: its connection closes)."""
    server = ServerProcess(
        ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"],
        engine_process=True,
    )
    try:
        server.wait_ready()
        children = psutil.Process(server.proc.pid).children()
        [engine] = [c for c in children if "vlmserve.engine.proc" in c.cmdline()]
        media = [c for c in children if any("spawn_main" in a for a in c.cmdline())]
        assert media, "no media worker"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        if how == "kill":
            server.proc.kill()
        else:
            server.proc.terminate()
        server.proc.wait(30)
        engine.wait(30)  # psutil.TimeoutExpired if it outlived the server
        for worker in media:  # the media workers too
            worker.wait(30)
    finally:
        server.stop()


def _stream_to_the_end(url: str, lines: list[str], first: threading.Event) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "on and on"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                first.set()


def test_a_stop_of_the_whole_service_finishes_its_streams_and_logs_no_error(
    tiny_dir: Path,
) -> None:
    """systemd and ``timeout`` send SIGTERM to every process of the service: the engine process
    waits for the server to close it, a stream in flight still ends with [DONE], and no line is
    logged as an ERROR (a crash still is: tests/integration/test_engine_process.py)."""
    server = ServerProcess(
        ["serve", "--model", str(tiny_dir), "--served-model-name", "tiny", "--device", "cpu"],
        engine_process=True,
    )
    lines: list[str] = []
    try:
        server.wait_ready()
        first = threading.Event()
        streaming = threading.Thread(target=_stream_to_the_end, args=(server.url, lines, first))
        streaming.start()
        assert first.wait(60)
        service = [server.proc, *psutil.Process(server.proc.pid).children(recursive=True)]
        # the server, its engine process, and its media workers (with their spawn helper)
        engines = [p for p in service[1:] if "vlmserve.engine.proc" in p.cmdline()]
        assert len(engines) == 1, [p.cmdline() for p in service[1:]]
        for process in service:  # what systemd's KillMode=control-group does
            process.send_signal(signal.SIGTERM)
        server.proc.wait(60)  # uvicorn ends by raising the signal again: -15
        streaming.join(60)
    finally:
        out = server.stop()
    assert "Shutting down" in out
    assert not [line for line in out.splitlines() if " ERROR " in line or "Traceback" in line]
    assert lines[-1] == "[DONE]" and '"error"' not in lines[-2]
