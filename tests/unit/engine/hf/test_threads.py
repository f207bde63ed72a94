"""Only a model's own thread runs torch with a thread team (``engine/hf/threads.py``).

A second team on a 2-core CPU made GNU OpenMP put the model thread's workers to sleep
between ops: ~114 futex wake-ups per decode step of the medium checkpoint and ~10 ms more per
token. These tests pin where each kind of work runs and with how many intra-op threads.
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from support import MODEL
from vlmserve.config import Settings
from vlmserve.engine.hf import chat as chat_module
from vlmserve.engine.hf import threads
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.embed import HFEmbedBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import EmbedInput
from vlmserve.media.workers.priority import thread_nice
from vlmserve.testing.media import data_url, image_bytes


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> int:
    """An op large enough for torch to split over its intra-op threads; -> the thread's
    intra-op thread count."""
    x = torch.randn(1500, 1500)
    (x * 2 + 1).sum()
    return torch.get_num_threads()


@pytest.mark.skipif(threads.DEFAULT_THREADS < 2, reason="one intra-op thread: never a team")
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_prep_threads_run_torch_without_a_team() -> None:
    prep = threads.prep_executor()
    prep.submit(lambda: None).result()  # the thread itself exists before counting
    before = _os_threads()
    assert prep.submit(_parallel_work).result() == 1
    assert _os_threads() == before  # an OpenMP team would have added its workers


def test_prep_threads_stay_single_threaded_whatever_torch_is_set_to_later() -> None:
    """torch's process-wide number changes (a model thread sets its own): a prep thread keeps
    one, including one started after the change."""
    model = threads.model_executor("test-model", threads=2)
    try:
        assert model.submit(torch.get_num_threads).result() == 2
        fresh = threads.prep_executor()
        results = [fresh.submit(_parallel_work) for _ in range(12)]  # starts new threads too
        assert {r.result() for r in results} == {1}
        assert model.submit(torch.get_num_threads).result() == 2
    finally:
        model.shutdown()


def test_a_model_has_exactly_one_thread() -> None:
    """Two threads for one model would be two teams again (and two forwards at once)."""
    model = threads.model_executor("test-model")
    names: set[str] = set()
    gate = threading.Event()
    try:
        first = model.submit(lambda: (gate.wait(10), names.add(threading.current_thread().name)))
        second = model.submit(lambda: names.add(threading.current_thread().name))
        assert not names
        time.sleep(0.2)
        assert not second.done()  # queued behind the first: there is no second thread
        gate.set()
        first.result(timeout=10)
        second.result(timeout=10)
        assert len(names) == 1
    finally:
        gate.set()
        model.shutdown()


def test_model_thread_gets_the_default_thread_count() -> None:
    model = threads.model_executor("test-model")
    try:
        threads.prep_executor().submit(_parallel_work).result()  # sets torch's number to 1
        assert model.submit(torch.get_num_threads).result() == threads.DEFAULT_THREADS
    finally:
        model.shutdown()


async def test_a_model_loads_on_its_own_thread(tiny_dir: Path) -> None:
    """Loading runs where the steps will (the load's team is the steps' team), not on a
    shared worker thread whose team would outlive it."""
    backend = HFChatBackend(
        "tiny", LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32"), max_model_len=4096
    )
    seen: list[str] = []
    real = backend._load

    def recording_load() -> object:
        seen.append(threading.current_thread().name)
        return real()

    backend._load = recording_load  # type: ignore[method-assign]
    try:
        await backend.aload()
        assert seen and seen[0].startswith("generate-tiny")
        steps = backend._executor.submit(lambda: threading.current_thread().name).result()
        assert steps == seen[0]
    finally:
        await backend.aclose()


def _recording_build(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Where each ``build_inputs`` runs: thread name, intra-op threads, OS nice value."""
    seen: list[tuple[str, int, int]] = []
    real = chat_module.build_inputs

    def recording(*args: Any) -> Any:
        seen.append((threading.current_thread().name, torch.get_num_threads(), thread_nice()))
        return real(*args)

    monkeypatch.setattr(chat_module, "build_inputs", recording)
    return seen


async def test_an_image_request_is_prepared_single_threaded_below_the_request_path(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The processor (image resizing, tokenizing) never starts a second team beside the
    model's, and runs at the media workers' lower priority (``media_worker_nice``)."""
    seen = _recording_build(monkeypatch)
    image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(), "image/png")}}
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [image]}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(seen) == 1
    name, count, nice = seen[0]
    assert name.startswith("vlmserve-media-prep") and count == 1
    expected = min(19, thread_nice() + Settings.model_fields["media_worker_nice"].default)
    assert nice == expected > thread_nice()


async def test_a_text_request_is_prepared_at_the_request_paths_priority(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat without images never runs on the threads that yield to media work."""
    seen = _recording_build(monkeypatch)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(seen) == 1
    name, count, nice = seen[0]
    assert name.startswith("vlmserve-prep") and count == 1
    assert nice == thread_nice()


class _WorkersUp:
    """A ``processor_cache.Remote`` that is up and hands every image back (done here)."""

    ready = True

    def __call__(self, shared: Any, kwargs: Any) -> None:
        return None


async def test_an_image_request_is_prepared_at_request_priority_once_the_workers_preprocess(
    client: httpx.AsyncClient, chat_models: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the image processor in the preprocessing workers, what is left of an image
    request's preparation (template, tokenizer, the wait) is short work under the GIL: below
    the request path's priority it would stall the request path's threads whenever a busy
    CPU kept it waiting while holding the GIL. A processor whose output the workers cannot
    return (bypassed) keeps it on the media threads."""
    cache = chat_models.handles[0].backend._processor_cache
    monkeypatch.setattr(cache, "remote", _WorkersUp())
    seen = _recording_build(monkeypatch)
    image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(), "image/png")}}
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [image]}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    name, _, nice = seen[-1]
    assert name.startswith("vlmserve-prep") and nice == thread_nice()

    monkeypatch.setattr(cache, "_bypass", True)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    name, _, nice = seen[-1]
    assert name.startswith("vlmserve-media-prep") and nice > thread_nice()


def test_media_prep_threads_run_lower_by_the_setting_and_single_threaded() -> None:
    assert threads.media_executor(3).submit(thread_nice).result() == min(19, thread_nice() + 3)
    assert threads.media_executor(3).submit(_parallel_work).result() == 1
    assert threads.prep_executor().submit(thread_nice).result() == thread_nice()


async def test_off_loop_carries_the_callers_context_as_to_thread_does() -> None:
    """Log records made while preparing a request keep its context (request id and such)."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="none")
    var.set("req-7")
    assert await threads.off_loop(var.get) == "req-7"


def test_a_small_cpu_model_computes_on_one_thread_and_a_large_one_on_the_default() -> None:
    small = torch.nn.Linear(64, 64)
    large = torch.nn.Module()
    large.weight = torch.nn.Parameter(torch.empty(threads.SMALL_MODEL_PARAMS, device="meta"))
    cpu = torch.device("cpu")
    assert threads.model_threads(small, cpu) == 1
    assert threads.model_threads(large, cpu) == threads.DEFAULT_THREADS
    assert threads.model_threads(small, torch.device("meta")) == threads.DEFAULT_THREADS


@pytest.mark.skipif(threads.DEFAULT_THREADS < 2, reason="one intra-op thread: never a team")
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
async def test_a_small_embedder_serves_without_starting_a_team(tiny_dir: Path) -> None:
    """Measured: a tiny embedder beside a medium chat model, after one embedding request,
    put the chat model's decode at 112 context switches per token (26 -> 37 ms)."""
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    embedder = HFEmbedBackend("tiny-embed", options)
    await embedder.aload()
    try:
        await embedder.embed([EmbedInput(text="warm up the thread")])
        before = _os_threads()
        vectors = await embedder.embed([EmbedInput(text="a red car " * 40)] * 8)
        assert vectors.shape[0] == 8
        assert embedder._executor.submit(torch.get_num_threads).result() == 1
        assert _os_threads() == before
    finally:
        await embedder.aclose()
