"""The engine's GPU path on a real CUDA device (skipped without one): the tiny Qwen2-VL in
bfloat16, the KV budget that keeps a prefill's activations free, and a real CUDA
out-of-memory error failing one request with a 503 while the engine goes on.

Run them (and ``benchmarks/gpu.py``) whenever a GPU is available: ``pytest tests/gpu``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vlmserve.engine.core.faults import OutOfMemory
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.models.profile import activation_peak, dummy_prefill
from vlmserve.engine.types import ChatMessage, GenerateRequest, SamplingParams, TextPart

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def backend(tiny_dir: Path) -> Iterator[HFChatBackend]:
    options = LoadOptions(source=str(tiny_dir), device="cuda", dtype="bfloat16")
    b = HFChatBackend(
        "tiny",
        options,
        max_model_len=4096,
        max_queued=64,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        vision_cache_bytes=0,
        processor_cache_bytes=0,
        cuda_graphs=True,
    )
    b.load()
    assert b.engine is not None, "the tiny Qwen2-VL must run on the batching engine on CUDA"
    yield b
    b.close()


def request(text: str, max_tokens: int = 16) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(text, [ChatMessage("user", [TextPart(text)])], params)


async def tokens(backend: HFChatBackend, req: GenerateRequest) -> list[int]:
    prepared = await backend.prepare(req)
    return [t async for chunk in backend.generate(prepared) for t in chunk.token_ids]


async def test_requests_run_together_on_cuda(backend: HFChatBackend) -> None:
    got = await asyncio.gather(*(tokens(backend, request(f"row {i}")) for i in range(8)))
    assert all(len(g) == 16 for g in got)
    assert backend.engine is not None and backend.engine.runner.device.type == "cuda"


def test_the_budget_leaves_a_full_prefills_activations_free(backend: HFChatBackend) -> None:
    engine = backend.engine
    assert engine is not None
    runner = engine.runner
    peak = activation_peak(runner, 2048, 16)
    assert peak > 0
    # what is left after the cache is allocated still holds the largest admitted prefill
    free, _ = torch.cuda.mem_get_info(CUDA)
    assert free >= peak
    logits = dummy_prefill(runner, 2048, 16)  # must not run out of memory
    assert torch.isfinite(logits.float()).all()


async def test_a_real_cuda_out_of_memory_fails_one_request_with_a_503(
    backend: HFChatBackend,
) -> None:
    engine = backend.engine
    assert engine is not None
    decode = engine._decode_forward
    alone = await tokens(backend, request("companion"))

    def greedy_for_memory(seqs: list[Any]) -> list[int]:
        if any("HUGE" in str(s.prepared.request.messages) for s in seqs):
            torch.empty(1 << 50, dtype=torch.uint8, device=CUDA)  # 1 PiB: a real CUDA OOM
        return decode(seqs)

    engine._decode_forward = greedy_for_memory  # type: ignore[method-assign]
    try:
        got = await asyncio.gather(
            tokens(backend, request("HUGE")),
            tokens(backend, request("companion")),
            return_exceptions=True,
        )
    finally:
        engine._decode_forward = decode  # type: ignore[method-assign]
    assert isinstance(got[0], OutOfMemory) and got[0].status_code == 503
    assert got[1] == alone
    assert engine.failure is None


def test_decode_reads_the_paged_cache_in_place_through_cuda_graphs(
    backend: HFChatBackend,
) -> None:
    engine = backend.engine
    assert engine is not None
    assert engine.decode_mode.startswith("paged attention, CUDA graphs"), engine.decode_mode
    cache = engine.runner.cache
    assert cache is not None
    gather = cache.gather

    def no_gather(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decode gathered cache blocks")

    cache.gather = no_gather  # type: ignore[method-assign]
    try:
        got = asyncio.run(_together(backend, 5))
    finally:
        cache.gather = gather  # type: ignore[method-assign]
    assert all(len(g) == 16 for g in got)
    assert engine.runner.paged is not None and engine.runner.paged.graphs


async def _together(backend: HFChatBackend, n: int, max_tokens: int = 16) -> list[list[int]]:
    return list(
        await asyncio.gather(*(tokens(backend, request(f"row {i}", max_tokens)) for i in range(n)))
    )


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_graph_replays_give_the_eager_steps_tokens_at_bucket_sizes(
    backend: HFChatBackend, rows: int
) -> None:
    engine = backend.engine
    assert engine is not None and engine.runner.paged is not None
    paged = engine.runner.paged
    graphed = asyncio.run(_together(backend, rows, 32))
    paged.use_graphs = False
    try:
        eager = asyncio.run(_together(backend, rows, 32))
    finally:
        paged.use_graphs = True
    assert graphed == eager


def test_the_paged_kernel_equals_gathered_attention_on_cuda() -> None:
    from vlmserve.engine.models import paged_attention as pa

    torch.manual_seed(0)
    blocks, size, kv_heads, dim, heads = 300, 16, 2, 128, 12
    lengths = [1, 16, 17, 300, 1000, 4000 - 1]
    width = max(-(-n // size) for n in lengths)
    for dtype in (torch.bfloat16, torch.float16):
        k = torch.randn(blocks, size, kv_heads, dim, dtype=dtype, device=CUDA)
        v = torch.randn(blocks, size, kv_heads, dim, dtype=dtype, device=CUDA)
        tables = torch.randint(1, blocks, (len(lengths), width), dtype=torch.int32, device=CUDA)
        q = torch.randn(len(lengths), heads, dim, dtype=dtype, device=CUDA)
        lens = torch.tensor(lengths, dtype=torch.int32, device=CUDA)
        got = pa.paged_decode(q, k, v, tables, lens, dim**-0.5, pa.splits_for(width, size))
        want = pa.reference(q, k, v, tables, lens, dim**-0.5)
        assert (got.float() - want.float()).abs().max().item() < 2e-2, dtype
