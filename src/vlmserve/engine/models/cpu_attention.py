"""Decode attention on CPU that reads the paged KV cache where it lies (``cpu_decode.c``).

The kernel is a small C file built once with the system C compiler (``-O3``, the host's
ISA, OpenMP) and loaded with ctypes: each row's keys and values are read through its block
table in the cache's dtype and converted in registers, with float32 scores and sums and an
online softmax; nothing is gathered, copied or cast. Threads split the work by units of a
row's KV heads, and each KV head's reductions run on one thread in one order, so a row's
result does not depend on its companions or the thread count (batch invariance). The
OpenMP runtime is torch's own (a library asking for ``libgomp.so.1`` gets the one torch
loaded), so the kernel's threads are the calling thread's torch team, at its thread count.

Where the CPU has bfloat16 dot-product instructions (AVX512-BF16), a bfloat16 cache's
decode runs on them: keys and values are multiplied in pairs as they lie, never converted,
and the probabilities are rounded to bfloat16 for the value sums (as torch's attention
does for bfloat16 inputs); about 1.4x faster than converting to float32 at 8 rows of 4,096
tokens. The same library holds ``cpu_prefill.c``: a prompt's causal attention in bfloat16
on those instructions, twice as fast as torch's CPU flash attention, which computes in
float32; elsewhere prefill keeps torch's kernel. And ``cpu_linear.c``: a decode step's
linear layers for its few rows in bfloat16 (``linear``), reading plain weights at memory
speed where oneDNN's packed product reads them at two thirds of it.

Built libraries are cached under ``VLMSERVE_KERNEL_CACHE`` (default
``~/.cache/vlmserve/kernels``), keyed by the source, the compiler, its flags and the CPU's
flags, so a later start loads in milliseconds. Where building is impossible (no C
compiler, a compile error) the runner keeps gathered attention and the log says why.

Under an ISA cap (``ATEN_CPU_CAPABILITY=avx2``, what CI runs the engine tests with) the
kernel is built for x86-64-v3 (AVX2, FMA, F16C) instead of the host's full ISA, so the cap
runs the code an AVX2-only machine would.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

__all__ = ["CpuPagedAttention", "KernelBuildError", "build_library", "paged_decode"]

log = logging.getLogger(__name__)

_SOURCES = ("cpu_decode.c", "cpu_prefill.c", "cpu_linear.c")  # one library
_HEADERS = ("cpu_bf16.h",)  # what they include: copied beside them and part of the key
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_decode.c's enum
_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
_PREFILL_ARGS = (
    [ctypes.c_void_p] * 5
    + [ctypes.c_int64] * 2
    + [ctypes.c_int]
    + [ctypes.c_int64] * 7
    + [ctypes.c_float, ctypes.c_int]
)
_LINEAR_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int]
_KT = 32  # cpu_prefill.c's keys a tile: the packed keys' length is rounded up to it


class KernelBuildError(RuntimeError):
    """The C compiler is missing or failed; the message says which and how."""


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The reference the kernel is tested against (it gathers): q [B, H, D]; k_cache, v_cache
    [num_blocks, block_size, KVH, D] (one layer); tables [B, MB] block ids; lengths [B] keys
    each row attends to (>= 1) -> [B, H, D] in q's dtype, computed in float32."""
    b, heads, dim = q.shape
    _, block, kv_heads, _ = k_cache.shape
    rep, width = heads // kv_heads, tables.shape[1]
    qf = q.float().view(b, 1, 1, kv_heads, rep, dim)
    keys = k_cache[tables].float()  # [B, MB, BS, KVH, D]
    scores = (qf * keys[..., None, :]).sum(-1) * scale  # [B, MB, BS, KVH, rep]
    pos = torch.arange(width * block, device=q.device).view(1, width, block, 1, 1)
    scores = scores.masked_fill(pos >= lengths.view(b, 1, 1, 1, 1), float("-inf"))
    p = torch.softmax(scores.flatten(1, 2), dim=1)  # [B, MB * BS, KVH, rep]
    values = v_cache[tables].float().flatten(1, 2)  # [B, MB * BS, KVH, D]
    out = (p[..., None] * values[..., None, :]).sum(1)  # [B, KVH, rep, D]
    return out.reshape(b, heads, dim).to(q.dtype)


def _isa_flags() -> list[str]:
    """The target ISA: the host's, or x86-64-v3 under ``ATEN_CPU_CAPABILITY=avx2``."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if platform.machine() in ("x86_64", "AMD64"):
        if cap == "avx2":
            return ["-march=x86-64-v3"]
        if cap == "default":
            return ["-march=x86-64"]
    return ["-march=native"]


def _cpu_flags() -> str:
    """The first CPU's feature flags (what ``-march=native`` builds for), or the machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    if folder := os.environ.get("VLMSERVE_KERNEL_CACHE"):
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "vlmserve" / "kernels"


def _compiler() -> list[str]:
    return (os.environ.get("CC") or "cc").split()


def build_library() -> Path:
    """The kernel's shared library, built now or found in the cache -> its path. Raises
    ``KernelBuildError`` when there is no C compiler or it fails."""
    files = {
        name: resources.files(__package__).joinpath(name).read_bytes()
        for name in _SOURCES + _HEADERS
    }
    cc = _compiler()
    flags = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-strict-aliasing"]
    flags += _isa_flags()
    try:
        version = subprocess.run(
            [*cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"no working C compiler ({' '.join(cc)}; set CC): {exc}") from exc
    key = hashlib.sha256(
        b"\0".join(x.encode() for x in (version, " ".join(flags), _cpu_flags()))
        + b"\0".join(files.values())
    ).hexdigest()[:24]
    folder = _cache_dir()
    target = folder / f"cpu_decode-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        for name, text in files.items():
            (Path(work) / name).write_bytes(text)
        paths = [Path(work) / name for name in _SOURCES]
        built = Path(work) / target.name
        done = subprocess.run(
            [*cc, *flags, *map(str, paths), "-o", str(built)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(cc)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: another process may be building the same
    return target


class CpuPagedAttention:
    """``cpu_decode.c`` loaded: ``paged_decode``'s contract, reading the cache in place."""

    def __init__(self, library: Path | None = None) -> None:
        started = time.perf_counter()
        lib = ctypes.CDLL(str(library or build_library()))
        self._fn = lib.paged_decode
        self._fn.argtypes, self._fn.restype = _ARGS, ctypes.c_int
        self._kinds = dict(_KINDS)
        if not lib.has_float16():  # the compiler has no _Float16
            del self._kinds[torch.float16]
        self._prefill = lib.prefill_attention
        self._prefill.argtypes, self._prefill.restype = _PREFILL_ARGS, ctypes.c_int
        self.prefills = bool(lib.has_prefill())  # the build has AVX512-BF16 (decode too)
        self._linear = lib.linear_bf16
        self._linear.argtypes, self._linear.restype = _LINEAR_ARGS, ctypes.c_int
        self.linears = bool(lib.has_linear())  # the same: ``cpu_linear.c``'s product
        self._lib = lib
        self.seconds = time.perf_counter() - started

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._kinds

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        first: int = 0,
        *,
        causal: bool = True,
    ) -> torch.Tensor | None:
        """Causal attention of a prompt's tokens in bfloat16 (``cpu_prefill.c``): q [T, H, D],
        the tokens at positions ``first``..``first + T - 1`` (those before them are a cached
        prefix or earlier chunks); k and v [>= first + T, KVH, D], every key from position 0
        (each token's heads contiguous; tokens may be strided) -> [T, H, D]; the token at
        position p attends to keys 0..p, or (``causal=False``, a vision tower's attention)
        every query to all ``first + T`` keys. None where the kernel does not apply (no
        AVX512-BF16 in this build, another dtype, a head layout past its buffers): use
        torch's attention."""
        if not self.prefills or q.dtype != torch.bfloat16:
            return None
        t, heads, dim = q.shape
        keys = first + t
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"keys {k.dtype} and values {v.dtype} are not the query's {q.dtype}")
        if k.shape[0] < keys or v.shape[0] < keys or k.shape[1:] != v.shape[1:]:
            raise ValueError(f"{t} queries after {first} need {keys} keys and values")
        kv_heads = k.shape[1]
        q, k, v = (
            x if x.stride(2) == 1 and x.stride(1) == dim else x.contiguous() for x in (q, k, v)
        )
        out = torch.empty(t, heads, dim, dtype=q.dtype)
        scratch = torch.empty(2 * -(-keys // _KT) * _KT * kv_heads * dim, dtype=q.dtype)
        failed = self._prefill(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            t,
            first,
            int(causal),
            heads,
            kv_heads,
            dim,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            out.stride(0),
            scale,
            torch.get_num_threads(),
        )
        return None if failed else out

    def takes_weight(self, weight: torch.Tensor) -> bool:
        """Whether ``linear`` computes products with this weight: a contiguous bf16
        [out, in] CPU matrix with ``in`` a multiple of 32, in a build with AVX512-BF16."""
        return (
            self.linears
            and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.is_contiguous()
            and weight.shape[1] % 32 == 0
        )

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """``out = x @ weight.T + bias`` in bf16 for a few rows (``cpu_linear.c``): x [rows,
        in] and out [rows, out_features] with unit stride along a row (rows may be strided),
        ``weight`` one ``takes_weight`` accepts, ``bias`` bf16 [out_features] or None. Each
        row's result is the same whatever the other rows and the thread count."""
        rows, width = x.shape
        if not self.takes_weight(weight) or weight.shape[1] != width:
            raise ValueError(f"the bf16 linear kernel takes no {tuple(weight.shape)} weight")
        if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
            raise ValueError(f"inputs {x.dtype} and outputs {out.dtype} must be bfloat16")
        if x.stride(1) != 1 or out.stride(1) != 1 or tuple(out.shape) != (rows, weight.shape[0]):
            raise ValueError("inputs and outputs must be [rows, features] with unit stride")
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            bias = bias.to(torch.bfloat16).contiguous()
        self._linear(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            weight.shape[0],
            width,
            x.stride(0),
            out.stride(0),
            torch.get_num_threads(),
        )

    def check(self, tables: torch.Tensor, lengths: torch.Tensor, blocks: int, block: int) -> None:
        """A ``ValueError`` unless every row's length is >= 1 and within its table and every
        table entry is a block of the cache: what the kernel reads must lie inside it."""
        if tables.numel() and (
            int(lengths.max()) > tables.shape[1] * block
            or int(lengths.min()) < 1
            or int(tables.max()) >= blocks
            or int(tables.min()) < 0
        ):
            raise ValueError("a decode row's table or length is out of the cache's range")

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        scale: float,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        """q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] contiguous, q's
        dtype; tables [B, MB] and lengths [B] int64 (every length >= 1 and within its
        table) -> [B, H, D]. A table or length out of range is a ``ValueError`` (the kernel
        would read past the cache); ``checked``: the caller has run ``check`` on these
        tables and lengths for this cache's shape, int64 and contiguous (the runner does it
        once a step, not once a layer)."""
        rows, heads, dim = q.shape
        blocks, block, kv_heads, _ = k_cache.shape
        kind = self._kinds[q.dtype]
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache must be contiguous")
        if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise ValueError(f"cache dtype {k_cache.dtype} is not the query's {q.dtype}")
        q = q.contiguous()
        if not checked:
            tables = tables.to(torch.int64).contiguous()
            lengths = lengths.to(torch.int64).contiguous()
            self.check(tables, lengths, blocks, block)
        width = tables.shape[1]
        out = torch.empty_like(q)
        failed = self._fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            lengths.data_ptr(),
            out.data_ptr(),
            rows,
            heads,
            kv_heads,
            dim,
            block,
            width,
            scale,
            kind,
            torch.get_num_threads(),
        )
        if failed:
            raise ValueError(f"head layout {heads}/{kv_heads} x {dim}, block {block}: too large")
        return out
