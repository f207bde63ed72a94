"""The decode step on CUDA: paged attention over persistent buffers, captured in CUDA graphs.

A decode step of a small model on a GPU is a few hundred small kernels (28 layers of norm,
projections, rotary, cache write, attention, MLP); launched one by one from Python, their
launch cost is many times the time the GPU needs to read the weights. ``PagedDecode`` runs
the step over persistent device buffers (token ids, positions, cache slots, lengths and block
tables), whose addresses never change, so the whole step can be captured once per batch-size
bucket (``BUCKETS``) and replayed with one launch:

- a batch of ``B`` rows runs in the smallest bucket ``n >= B``; rows ``B..n-1`` are padding:
  token 0 at position 0, writing their K/V to the null block (block 0, which no sequence
  owns: on this path nothing reads it as padding, since attention stops at each row's
  length) and attending to it alone (length 1), so they touch nothing real;
- attention reads each row's blocks in place (``paged_attention.paged_decode``): its shapes
  do not depend on the rows' lengths, so one graph serves every context;
- the rotary tables are grown to the cache's capacity before capture (a position past them
  grows the tables and drops the graphs, which are captured again on use);
- a batch above the largest bucket, a runner whose decode hooks differ from the base
  runner's (Gemma 3's sliding windows) or linears that are not plain weights (a quantized
  checkpoint) run eagerly, with a log line; ``--enforce-eager`` runs every step eagerly.

The eager path runs the same function over the same buffers with ``n = B``: at a batch size
equal to a bucket, graph and eager steps are the same kernels on the same inputs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from vlmserve.engine.core.block_manager import NULL_BLOCK
from vlmserve.engine.models import paged_attention

if TYPE_CHECKING:
    from vlmserve.engine.models.runner import DecoderRunner

__all__ = [
    "BUCKETS",
    "PagedDecode",
    "base_decode",
    "bucket_for",
    "graphs_unsupported",
    "paged_supported",
]

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``rows`` rows (None: more than the largest)."""
    return next((n for n in buckets if n >= rows), None)


class PagedDecode:
    def __init__(self, runner: DecoderRunner, max_rows: int, max_len: int = 0, *, graphs: bool):
        """``max_rows``: the most rows a step decodes (``max_num_seqs``); ``max_len``: the
        most tokens a row holds (``max_model_len``; 0: the whole cache); ``graphs``: capture
        CUDA graphs (on CUDA, unless ``--enforce-eager``)."""
        cache = runner._kv()
        self.runner, self.cache = runner, cache
        self.block_size = cache.block_size
        self.scratch = NULL_BLOCK
        self.max_blocks = cache.num_blocks  # a row never holds more blocks than exist
        if max_len:
            self.max_blocks = min(self.max_blocks, -(-max_len // self.block_size))
        self.splits = paged_attention.splits_for(self.max_blocks, self.block_size)
        self.buckets = (*(n for n in BUCKETS if n < max_rows), max_rows)
        rows = max(self.buckets)
        device = runner.device
        # [5, rows]: token id, rotary position, cache slot, keys attended (length + 1), row
        self.host = torch.zeros(4, rows, dtype=torch.long, pin_memory=device.type == "cuda")
        self.ints = torch.zeros(4, rows, dtype=torch.long, device=device)
        self.lengths = torch.ones(rows, dtype=torch.int32, device=device)
        self.tables = torch.full(
            (rows, self.max_blocks), self.scratch, dtype=torch.int32, device=device
        )
        self.positions = max(4096, self.max_blocks * self.block_size)
        for tables in runner.ropes.values():
            tables.text(torch.zeros(1, dtype=torch.long, device=device), self.positions)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.use_graphs = graphs and device.type == "cuda"
        self._pool: Any = None
        self._tables_at = self._rope_addresses()  # the rotary tables the graphs read
        self.captured_seconds = 0.0

    def _rope_addresses(self) -> tuple[int, ...]:
        return tuple(t.cos_full.data_ptr() for t in self.runner.ropes.values())

    # --- one step ---------------------------------------------------------------------
    def run(
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """``DecoderRunner.decode``'s contract: logits [B, V]."""
        rows = len(tokens)
        highest = max(positions)
        if highest >= self.positions:  # grow the rotary tables; graphs read the old ones
            self.positions = 2 * (highest + 1)
            for rope in self.runner.ropes.values():
                rope.text(
                    torch.zeros(1, dtype=torch.long, device=self.runner.device), self.positions
                )
        if self._rope_addresses() != self._tables_at:  # grown here or by a prefill
            self.graphs.clear()
            self._tables_at = self._rope_addresses()
        bucket = bucket_for(rows, self.buckets) if self.use_graphs else None
        n = bucket or rows
        self._fill(tokens, positions, lengths, tables, n)
        if bucket is None:
            return self.step(n)
        if bucket not in self.graphs and not self._try_capture(bucket):
            return self.step(rows)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:rows]

    def _fill(
        self,
        tokens: list[int],
        positions: list[int],
        lengths: list[int],
        tables: list[list[int]],
        n: int,
    ) -> None:
        """Write the step's inputs into the persistent buffers' first ``n`` rows (rows past
        the batch: padding, see the module docstring). One host->device copy each for the
        ints and the tables."""
        bs, rows = self.block_size, len(tokens)
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, lengths, strict=True)]
        pad = n - rows
        host = self.host[:, :n]
        host[0, :rows] = torch.tensor(tokens)
        host[1, :rows] = torch.tensor(positions)
        host[2, :rows] = torch.tensor(slots)
        host[3, :rows] = torch.tensor(lengths)
        if pad:
            host[:, rows:] = 0
            host[2, rows:] = self.scratch * bs
        self.ints[:, :n].copy_(host, non_blocking=True)
        self.lengths[:n].copy_(self.ints[3, :n] + 1)
        width = max(len(t) for t in tables)
        table = torch.tensor(
            [t + [self.scratch] * (width - len(t)) for t in tables], dtype=torch.int32
        )
        self.tables[:rows, :width].copy_(table, non_blocking=True)
        if pad:
            self.tables[rows:n, 0] = self.scratch

    def step(self, n: int) -> torch.Tensor:
        """The decode forward of the buffers' first ``n`` rows -> logits [n, V]. Nothing
        here reads a host value, so it can be captured."""
        run, cache = self.runner, self.cache
        ids, positions, slots = self.ints[0, :n], self.ints[1, :n], self.ints[2, :n]
        tables, lengths = self.tables[:n], self.lengths[:n]  # [n, MB], [n] int32
        x = run.embed(ids)  # [n, hidden]
        ropes = {k: (t.cos_full[positions], t.sin_full[positions]) for k, t in run.ropes.items()}
        for li, layer in enumerate(run.layers):
            q, k, v = run._qkv(x, layer, *ropes[layer.kind])  # q [n, H, D], k/v [n, KVH, D]
            cache.write(li, slots, k, v)
            o = paged_attention.paged_decode(
                q, cache.k[li], cache.v[li], tables, lengths, run.scale, self.splits
            )  # [n, H, D]
            x = run._mlp(x, o.reshape(n, -1), layer)
        return run._logits(x)

    # --- graphs -------------------------------------------------------------------------
    def _capture(self, n: int) -> None:
        """Capture the step of bucket ``n``. The warm-up steps before it run on the buffers'
        current contents (the caller's inputs), writing the same K/V the replay writes."""
        started = time.perf_counter()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # compile Triton kernels, pick cuBLAS algorithms
                self.step(n)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another model's work on this GPU from another thread (an embedding
        # model, say) does not break the capture
        capture = torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local")
        with torch.inference_mode(), capture:
            logits = self.step(n)
        self.graphs[n] = (graph, logits)  # the warm-up wrote the rows' K/V: same values
        log.debug("captured the decode step of %d rows in %.2f s", n, time.perf_counter() - started)

    def _try_capture(self, n: int) -> bool:
        """``_capture``; where capturing fails, every step from then on runs eagerly (and
        the log says why)."""
        try:
            self._capture(n)
        except Exception as exc:
            log.warning("decode steps run eagerly: capturing a CUDA graph failed (%s)", exc)
            self.use_graphs = False
            self.graphs.clear()
            return False
        return True

    def capture_all(self) -> float:
        """Capture every bucket now, largest first (they share one memory pool), on
        padding rows only, so no request pays for a capture. -> seconds taken."""
        started = time.perf_counter()
        for n in sorted(self.buckets, reverse=True):
            if not self.use_graphs:
                break
            self._fill([0] * n, [0] * n, [0] * n, [[self.scratch]] * n, n)
            self._try_capture(n)
        self.captured_seconds = time.perf_counter() - started
        return self.captured_seconds


def base_decode(runner: DecoderRunner) -> bool:
    """Whether the runner's decode attention is the base runner's (causal over each row's
    tokens): a runner with its own masks or attention (Gemma 3's sliding windows) keeps
    its own decode."""
    from vlmserve.engine.models.runner import DecoderRunner

    cls = type(runner)
    return all(
        getattr(cls, hook) is getattr(DecoderRunner, hook)
        for hook in ("decode", "_decode_masks", "_decode_attention")
    )


def paged_supported(runner: DecoderRunner) -> bool:
    """Whether the Triton paged decode step applies: the base runner's attention on a
    device Triton runs on."""
    return base_decode(runner) and paged_attention.available(runner.device)


def graphs_unsupported(runner: DecoderRunner) -> str | None:
    """None when the paged decode step can be captured in CUDA graphs; else why not."""
    from vlmserve.engine.models.linear import ModuleLinear

    if runner.device.type != "cuda":
        return "graphs are CUDA's"
    if any(
        isinstance(lin, ModuleLinear)
        for layer in runner.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ):
        return "its linears are not plain weights (a quantized checkpoint)"
    return None
