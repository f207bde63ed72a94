"""Continuous batching in the hf engine, on the tiny real Qwen2-VL (no mocks).

The contract pinned here: a request's greedy tokens do not depend on what else is in the
batch (images, video, text, rows joining and leaving mid-flight); seeded sampling does not
either; closing a stream takes its row out within a step; a resumed stream continues
exactly; the batch and the queue stay within their bounds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from vlmserve.engine.core import engine as engine_module
from vlmserve.engine.core.sampler import Sampler
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.inputs import Prepared
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.types import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    ImagePart,
    SamplingParams,
    TextPart,
    VideoPart,
)
from vlmserve.errors import Overloaded
from vlmserve.testing.media import gradient_image


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    finish: FinishReason | None = None
    completion_tokens: int = 0


def make_backend(tiny_dir: Path, **kw: Any) -> HFChatBackend:
    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    kw = {
        "max_model_len": 4096,
        "max_queued": 64,
        "vision_cache_bytes": 0,
        "processor_cache_bytes": 0,
        **kw,
    }
    backend = HFChatBackend("tiny", options, **kw)
    backend.load()
    assert backend.engine is not None, "the tiny Qwen2-VL must run on the batching engine"
    return backend


def request(
    text: str,
    *,
    image: tuple[int, int] | None = None,
    video: int = 0,
    max_tokens: int = 24,
    temperature: float = 0.0,
    seed: int | None = None,
    image_seed: int = 0,
    **sampling: Any,
) -> GenerateRequest:
    parts: list[Any] = []
    if image is not None:
        parts.append(ImagePart(gradient_image(*image, seed=image_seed)))
    if video:
        parts.append(VideoPart([gradient_image(56, 56, seed=40 + i) for i in range(video)]))
    parts.append(TextPart(text))
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True, **sampling
    )
    return GenerateRequest("test", [ChatMessage("user", parts)], params)


async def run(
    backend: HFChatBackend, req: GenerateRequest, on_chunk: Callable[[Outcome], None] | None = None
) -> Outcome:
    return await drain(backend, await backend.prepare(req), on_chunk)


async def drain(
    backend: HFChatBackend, prepared: Prepared, on_chunk: Callable[[Outcome], None] | None = None
) -> Outcome:
    """Generate an already prepared request to its end."""
    out = Outcome()
    async for chunk in backend.generate(prepared):
        out.tokens += chunk.token_ids
        out.text += chunk.text
        out.reasoning += chunk.reasoning
        out.completion_tokens = chunk.completion_tokens
        out.finish = chunk.finish_reason or out.finish
        if on_chunk is not None:
            on_chunk(out)
    return out


async def start_all(
    backend: HFChatBackend, reqs: list[GenerateRequest]
) -> list[asyncio.Task[Outcome]]:
    """The requests generating side by side, each prepared before any starts: a slow
    processor on a busy machine cannot let the short ones end before the last is in."""
    prepared = [await backend.prepare(r) for r in reqs]
    return [asyncio.create_task(drain(backend, p)) for p in prepared]


async def concurrently(backend: HFChatBackend, reqs: list[GenerateRequest]) -> list[Outcome]:
    """Run requests side by side (``start_all``) to their ends."""
    return list(await asyncio.gather(*await start_all(backend, reqs)))


async def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


@pytest.fixture(scope="module")
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    b = make_backend(tiny_dir, max_num_seqs=8)
    yield b
    b.close()


def mixed_batch() -> list[GenerateRequest]:
    """Seven requests of different prompt and output lengths: images, text only, a video."""
    return [
        request("Describe it.", image=(64, 48), max_tokens=40),
        request("A much longer text-only prompt " * 6, max_tokens=55),
        request("What is shown?", image=(120, 90), image_seed=3, max_tokens=30),
        request("Short.", max_tokens=45),
        request("And the video?", video=4, max_tokens=50),
        request("Two words", image=(30, 200), image_seed=5, max_tokens=35),
        request("Tell me a story " * 3, max_tokens=60),
    ]


@pytest.mark.parametrize(
    "probe",
    [
        request("Probe with a picture", image=(80, 80), image_seed=9, max_tokens=32),
        request("Probe in plain text, a little longer than the others", max_tokens=32),
    ],
    ids=["image", "text"],
)
async def test_greedy_output_is_identical_alone_and_joining_a_busy_batch(
    backend: HFChatBackend, probe: GenerateRequest
) -> None:
    others = mixed_batch()
    alone = [await run(backend, r) for r in [*others, probe]]
    tasks = await start_all(backend, others)
    await wait_for(lambda: backend.engine.gauges.running == 7)  # type: ignore[union-attr]
    started = backend.engine.steps  # type: ignore[union-attr]
    await wait_for(lambda: backend.engine.steps >= started + 3)  # type: ignore[union-attr]
    joined = await run(backend, probe)  # joins mid-flight; others leave while it decodes
    together = [*await asyncio.gather(*tasks), joined]
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert [o.text for o in together] == [o.text for o in alone]
    assert all(
        len(o.tokens) == r.sampling.max_tokens
        for o, r in zip(together, [*others, probe], strict=True)
    )


async def test_batched_greedy_matches_transformers_generate(backend: HFChatBackend) -> None:
    """The runner's own forward (M-RoPE, fused projections, KV slots) equals HF's model."""
    loaded = backend._require()
    for req in [
        request("Describe it.", image=(64, 48), max_tokens=24),
        request("What happens?", video=4, max_tokens=24),
        request("Plain text", max_tokens=24, repetition_penalty=1.3),
    ]:
        ours = await run(backend, req)
        prepared = await backend.prepare(req)
        with torch.inference_mode():
            out = loaded.model.generate(
                **prepared.inputs,
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                repetition_penalty=req.sampling.repetition_penalty,
            )
        assert ours.tokens == out[0, prepared.prompt_tokens :].tolist()


async def test_closing_a_stream_removes_its_row_within_a_step_and_others_continue(
    backend: HFChatBackend,
) -> None:
    engine = backend.engine
    assert engine is not None
    keep = [request("Keep going", image=(64, 48), max_tokens=60), request("Me too", max_tokens=60)]
    expected = [await run(backend, r) for r in keep]
    prepared = await backend.prepare(request("Cancel me", max_tokens=400))
    doomed = backend.generate(prepared)
    await anext(doomed)
    row = next(s for s in engine.scheduler.running if s.prepared is prepared)
    tasks = await start_all(backend, keep)
    await wait_for(lambda: engine.gauges.running == 3)
    await doomed.aclose()
    closed_at = engine.steps
    await wait_for(lambda: row.finished_step >= 0)
    assert row.finished_step - closed_at <= 1  # the step under way ends, the next drops it
    assert row.run.completion < 400
    assert [o.tokens for o in await asyncio.gather(*tasks)] == [o.tokens for o in expected]


@pytest.mark.parametrize("image", [None, (64, 48)])
async def test_resume_with_prefix_tokens_gives_the_uninterrupted_continuation(
    backend: HFChatBackend, image: tuple[int, int] | None
) -> None:
    full = await run(backend, request("Tell me a story", image=image, max_tokens=30))
    resumed = request("Tell me a story", image=image, max_tokens=30)
    resumed.prefix_token_ids = full.tokens[:12]
    rest = await run(backend, resumed)
    assert rest.tokens == full.tokens[12:]
    assert rest.completion_tokens == 30 and rest.finish is FinishReason.LENGTH
    first = await run(backend, request("Tell me a story", image=image, max_tokens=12))
    assert first.text + rest.text == full.text


async def test_seeded_sampling_is_the_same_whatever_shares_the_batch(
    backend: HFChatBackend,
) -> None:
    seeded = request("Sample me", image=(64, 48), temperature=1.0, seed=1234, max_tokens=30)
    alone = await run(backend, seeded)
    again = await run(backend, seeded)
    companions = [request(f"Noise {i}", temperature=1.0, max_tokens=40) for i in range(4)]
    companions.append(request("Other seed", temperature=0.8, seed=7, top_k=20, max_tokens=40))
    tasks = await start_all(backend, companions)
    await wait_for(lambda: backend.engine.gauges.running == 5)  # type: ignore[union-attr]
    busy = await run(backend, seeded)
    await asyncio.gather(*tasks)
    other = await run(
        backend, request("Sample me", image=(64, 48), temperature=1.0, seed=99, max_tokens=30)
    )
    assert alone.tokens == again.tokens == busy.tokens
    assert other.tokens != alone.tokens  # it really samples


async def test_max_num_seqs_bounds_the_rows_decoding_together(tiny_dir: Path) -> None:
    backend = make_backend(tiny_dir, max_num_seqs=2)
    try:
        reqs = [request(f"Request {i}", max_tokens=12 + i) for i in range(4)]
        alone = [await run(backend, r) for r in reqs]
        events: list[tuple[str, int]] = []

        def watch(i: int) -> Callable[[Outcome], None]:
            return lambda out: None if ("first", i) in events else events.append(("first", i))

        async def one(i: int) -> Outcome:
            out = await run(backend, reqs[i], watch(i))
            events.append(("done", i))
            return out

        together = await asyncio.gather(*(one(i) for i in range(4)))
        assert backend.engine.peak_running == 2  # type: ignore[union-attr]
        first_done = events.index(next(e for e in events if e[0] == "done"))
        late_starts = sorted(events.index(e) for e in events if e[0] == "first")[2:]
        assert all(pos > first_done for pos in late_starts)  # waited for a free row
        assert [o.tokens for o in together] == [o.tokens for o in alone]
    finally:
        backend.close()


async def test_max_num_seqs_1_runs_one_request_at_a_time(tiny_dir: Path) -> None:
    backend = make_backend(tiny_dir, max_num_seqs=1)
    try:
        reqs = [request("One", image=(64, 48), max_tokens=10), request("Two", max_tokens=10)]
        together = await asyncio.gather(*(run(backend, r) for r in reqs))
        assert backend.engine.peak_running == 1  # type: ignore[union-attr]
        assert [o.tokens for o in together] == [(await run(backend, r)).tokens for r in reqs]
    finally:
        backend.close()


async def test_a_full_queue_answers_overloaded_and_drains_when_rows_free(tiny_dir: Path) -> None:
    backend = make_backend(tiny_dir, max_num_seqs=1, max_queued=1)
    engine = backend.engine
    assert engine is not None
    try:
        running = backend.generate(await backend.prepare(request("Long", max_tokens=500)))
        await anext(running)
        waiting = backend.generate(await backend.prepare(request("Queued", max_tokens=5)))
        waiting_first = asyncio.create_task(anext(waiting))
        await wait_for(lambda: engine.gauges.queued == 1)
        refused = backend.generate(await backend.prepare(request("Refused", max_tokens=5)))
        with pytest.raises(Overloaded, match="VLMSERVE_MAX_QUEUED_REQUESTS"):
            await anext(refused)
        assert not waiting_first.done()  # still waiting for the only row
        await running.aclose()
        chunk = await asyncio.wait_for(waiting_first, 30)
        assert chunk.token_ids  # it runs now
        await waiting.aclose()
    finally:
        backend.close()


async def test_stop_strings_and_max_tokens_end_rows_in_a_batch(backend: HFChatBackend) -> None:
    base = await run(backend, request("Stop test", max_tokens=30))
    stop = base.text[len(base.text) // 2 :][:3]
    reqs = [request("Stop test", max_tokens=30, stop=[stop]), request("Other", max_tokens=30)]
    stopped, other = await asyncio.gather(*(run(backend, r) for r in reqs))
    assert stopped.finish is FinishReason.STOP and stop not in stopped.text
    assert base.text.startswith(stopped.text) and len(stopped.tokens) < 30
    assert other.finish is FinishReason.LENGTH and len(other.tokens) == 30


async def test_response_format_rows_decode_valid_json_in_a_batch(backend: HFChatBackend) -> None:
    pytest.importorskip("xgrammar")
    import json

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    reqs = []
    for seed in range(3):
        r = request("JSON please", temperature=1.0, seed=seed, max_tokens=40)
        r.sampling.ignore_eos = False
        r.response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        reqs.append(r)
    outs = await asyncio.gather(*(run(backend, r) for r in [*reqs, request("free", max_tokens=40)]))
    for out in outs[:3]:
        assert out.finish is FinishReason.STOP
        assert isinstance(json.loads(out.text)["n"], int)
    assert len(outs[3].tokens) == 40


def test_sampler_bans_eos_until_min_tokens_and_top_k_1_is_greedy() -> None:
    sampler = Sampler(vocab_size=8, eos_ids={5})

    @dataclass
    class Run:
        completion: int

    @dataclass
    class Row:  # the fields of a Sequence the sampler reads
        sampling: SamplingParams
        run: Run
        matcher: Any = None
        seen: Any = None
        generator: Any = None

    logits = torch.tensor([[0.0, 1, 2, 3, 4, 9, 1, 0]] * 3)
    rows = [
        Row(SamplingParams(temperature=0, min_tokens=2), Run(1)),
        Row(SamplingParams(temperature=0, min_tokens=2), Run(2)),
        Row(SamplingParams(temperature=1.5, top_k=1, min_tokens=3), Run(0)),
    ]
    assert sampler.sample(logits.clone(), rows) == [4, 5, 4]  # type: ignore[arg-type]


def test_sampled_tokens_follow_the_distribution_and_never_take_a_masked_token() -> None:
    sampler = Sampler(vocab_size=6, eos_ids=set())

    @dataclass
    class Run:
        completion: int = 0

    @dataclass
    class Row:
        sampling: SamplingParams
        run: Run = field(default_factory=Run)
        matcher: Any = None
        seen: Any = None
        generator: Any = None

    probs = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.2, 0.0])  # zeros: masked, as a grammar does
    logits = probs.log().expand(8, 6)
    rows = [Row(SamplingParams(temperature=1.0)) for _ in range(8)]
    counts = torch.zeros(6)
    for _ in range(500):
        for token in sampler.sample(logits.clone(), rows):  # type: ignore[arg-type]
            counts[token] += 1
    assert counts[[1, 3, 5]].sum() == 0
    share = counts / counts.sum()  # 4,000 draws: 3 sigma is about 0.024
    assert torch.allclose(share, probs, atol=0.03), share.tolist()


async def test_a_lagging_consumer_gets_the_backlog_merged_into_fewer_chunks(
    backend: HFChatBackend,
) -> None:
    req = request("Lag behind", max_tokens=80)
    expected = await run(backend, req)
    stream = backend.generate(await backend.prepare(req))
    first = await anext(stream)
    engine = backend.engine
    assert engine is not None
    await wait_for(lambda: engine.gauges.running == 0)  # everything produced while we did not read
    rest = [chunk async for chunk in stream]
    assert len(rest) < 40  # 79 tokens arrived in far fewer chunks
    assert first.token_ids + [t for c in rest for t in c.token_ids] == expected.tokens
    assert first.text + "".join(c.text for c in rest) == expected.text
    assert rest[-1].finish_reason is FinishReason.LENGTH and rest[-1].completion_tokens == 80


async def test_prompts_over_the_prefill_token_budget_still_run_one_per_step(
    tiny_dir: Path,
) -> None:
    backend = make_backend(tiny_dir, max_num_seqs=4, max_num_batched_tokens=8)
    try:
        reqs = [
            request(f"A prompt well over eight tokens, number {i}", max_tokens=6) for i in range(3)
        ]
        alone = [await run(backend, r) for r in reqs]
        together = await asyncio.gather(*(run(backend, r) for r in reqs))
        assert [o.tokens for o in together] == [o.tokens for o in alone]
    finally:
        backend.close()


async def _events_per_row(backend: HFChatBackend, rows: int, tokens: int) -> list[list[int]]:
    """Token counts of each stream event, per row, for `rows` concurrent requests."""
    sizes: list[list[int]] = [[] for _ in range(rows)]

    async def consume(i: int) -> None:
        prepared = await backend.prepare(request(f"Row {i}", max_tokens=tokens))
        async for chunk in backend.generate(prepared):
            if chunk.token_ids:
                sizes[i].append(len(chunk.token_ids))

    await asyncio.gather(*(consume(i) for i in range(rows)))
    return sizes


async def test_a_busy_batch_streams_tokens_in_groups_of_stream_interval(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "GROUP_WAIT_S", 60.0)  # group by steps alone
    means = {}
    for interval in (1, 4):
        backend = make_backend(tiny_dir, max_num_seqs=8, stream_interval=interval)
        try:
            sizes = await _events_per_row(backend, rows=6, tokens=48)
        finally:
            backend.close()
        assert all(sum(s) == 48 for s in sizes)  # grouping never drops or repeats a token
        means[interval] = sum(map(sum, sizes)) / sum(map(len, sizes))
    # Fewer, larger events under load: not 4 tokens an event, because the rows join over
    # several steps and finish at the same one, and below 4 rows every step is sent at once.
    # With an interval of 1 a reader that falls behind on a slow machine also gets merged
    # events, so the interval-1 mean is a bound below, not a fixed 1.
    # 2.29 seen on a loaded machine with the interval kept; ignored, it is 1-1.4
    assert means[4] >= 2.0, means
    assert means[4] > means[1], means


async def test_no_token_waits_longer_than_the_group_wait_for_its_group(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "GROUP_WAIT_S", 0.0)  # every step is long enough
    backend = make_backend(tiny_dir, max_num_seqs=8, stream_interval=4)
    try:
        sizes = await _events_per_row(backend, rows=6, tokens=24)
    finally:
        backend.close()
    assert all(sum(s) == 24 for s in sizes)
    # the consumer may still merge chunks that piled up in its queue, but the engine sent
    # each step's token at once: far from groups of 4
    assert sum(map(sum, sizes)) / sum(map(len, sizes)) < 2.0, sizes


def test_admission_holds_queue_places_for_requests_still_preparing(tiny_dir: Path) -> None:
    backend = make_backend(tiny_dir, max_num_seqs=1, max_queued=2)
    try:
        first, second = backend.admit(), backend.admit()
        with pytest.raises(Overloaded):
            backend.admit()  # two places are held although the engine's queue is empty
        first()
        first()  # releasing twice frees one place only
        third = backend.admit()
        with pytest.raises(Overloaded):
            backend.admit()
        second(), third()
        backend.admit()()
    finally:
        backend.close()
