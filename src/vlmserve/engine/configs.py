"""Typed configuration of each in-process backend kind, built once from ``Settings``.

The defaults live in one place, ``config.Settings``; ``defaults(**changes)`` reads them from
there (not from the environment) for code that builds a backend without a server (tests,
benchmarks). Upstream backends have theirs in ``gateway/upstream.UpstreamConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

from vlmserve.config import Settings

__all__ = ["ChatEngineConfig", "EmbedConfig", "LoadOptions", "RerankConfig", "batched_tokens"]

_C = TypeVar("_C")


@dataclass(slots=True)
class LoadOptions:
    """Where a checkpoint is and how to load it; here, apart from the loader, so that a
    process that only names a model (an engine process's parent) never imports torch."""

    source: str
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    min_pixels: int | None = None
    max_pixels: int | None = None
    chat_template: str | None = None  # Jinja text replacing the checkpoint's (--chat-template)


def _defaults(cls: type[_C], mapping: dict[str, str], changes: dict[str, Any]) -> _C:
    values = {
        name: Settings.model_fields[setting].get_default(call_default_factory=True)
        for name, setting in mapping.items()
    }
    return replace(cls(**values), **changes)  # type: ignore[type-var]


@dataclass(slots=True, frozen=True)
class ChatEngineConfig:
    """What ``HFChatBackend`` and its batching engine need (each field's setting alongside)."""

    max_model_len: int  # max_model_len: prompt + completion tokens
    max_queued: int  # max_queued_requests: waiting requests before 429
    max_num_seqs: int  # sequences decoded together; 1 = one at a time
    max_num_batched_tokens: int | None  # prompt tokens per step; None: by device
    decode_share: float  # least share of engine time the streams decode while prompts wait
    vision_cache_bytes: int  # vision-tower outputs kept by content hash; 0 = off
    processor_cache_bytes: int  # preprocessed images by content; 0 = off
    media_nice: int  # media_worker_nice: the processor on media requests, below requests'
    stream_interval: int  # tokens per stream event when the batch is busy
    kv_cache_bytes: int  # kv_cache_memory: the KV budget; 0 = auto
    gpu_memory_utilization: float  # share of the GPU the model may use (weights + KV)
    prefix_caching: bool  # enable_prefix_caching: reuse cached prompt blocks' K/V
    cuda_graphs: bool  # CUDA: paged decode attention, the step as CUDA graphs
    enforce_eager: bool  # with cuda_graphs: the paged step without graphs
    reasoning_parser: str | None  # qwen3 | deepseek_r1; None: detected from the template
    tool_call_parser: str | None  # hermes; None: hermes when a request has tools
    logprobs_mode: str  # raw | processed
    preprocess_workers: int = 0  # media_workers, in an engine process: ``hf/preprocess.py``

    _SETTINGS: ClassVar[dict[str, str]] = {
        "max_model_len": "max_model_len",
        "max_queued": "max_queued_requests",
        "max_num_seqs": "max_num_seqs",
        "max_num_batched_tokens": "max_num_batched_tokens",
        "decode_share": "decode_share",
        "vision_cache_bytes": "vision_cache_bytes",
        "processor_cache_bytes": "processor_cache_bytes",
        "media_nice": "media_worker_nice",
        "stream_interval": "stream_interval",
        "kv_cache_bytes": "kv_cache_memory",
        "gpu_memory_utilization": "gpu_memory_utilization",
        "prefix_caching": "enable_prefix_caching",
        "cuda_graphs": "cuda_graphs",
        "enforce_eager": "enforce_eager",
        "reasoning_parser": "reasoning_parser",
        "tool_call_parser": "tool_call_parser",
        "logprobs_mode": "logprobs_mode",
    }

    @classmethod
    def from_settings(cls, settings: Settings, **changes: Any) -> ChatEngineConfig:
        values = {name: getattr(settings, s) for name, s in cls._SETTINGS.items()}
        return replace(cls(**values), **changes)

    @classmethod
    def defaults(cls, **changes: Any) -> ChatEngineConfig:
        return _defaults(cls, cls._SETTINGS, changes)


def batched_tokens(setting: int | None, device_type: str) -> int:
    """Prompt tokens one engine step computes: the setting, else vLLM's API-server default
    for the device. A step's prefill is what a running stream waits for between two tokens:
    on a CPU 2,048 tokens of a 2B model take about as long as vLLM lets a stream wait there
    (its CPU default is the same); a GPU computes 8,192 in a few tens of milliseconds."""
    if setting is not None:
        return setting
    return 2048 if device_type == "cpu" else 8192


@dataclass(slots=True, frozen=True)
class EmbedConfig:
    """What ``HFEmbedBackend`` needs besides its load options and adapter."""

    max_batch: int  # embed_max_batch_size: items in one forward pass
    batch_wait_ms: float  # embed_batch_wait_ms: how long a request waits for others

    _SETTINGS: ClassVar[dict[str, str]] = {
        "max_batch": "embed_max_batch_size",
        "batch_wait_ms": "embed_batch_wait_ms",
    }

    @classmethod
    def from_settings(cls, settings: Settings, **changes: Any) -> EmbedConfig:
        values = {name: getattr(settings, s) for name, s in cls._SETTINGS.items()}
        return replace(cls(**values), **changes)

    @classmethod
    def defaults(cls, **changes: Any) -> EmbedConfig:
        return _defaults(cls, cls._SETTINGS, changes)


@dataclass(slots=True, frozen=True)
class RerankConfig:
    """What ``HFRerankBackend`` needs besides its load options."""

    max_batch: int  # rerank_max_batch_size: query-document pairs in one forward pass
    batch_wait_ms: float  # embed_batch_wait_ms: how long a request waits for others
    max_model_len: int  # max_model_len: tokens of one pair (prompt, media included)
    # max_num_batched_tokens: prompt tokens one forward packs (None: ``batched_tokens``'s
    # default for the device); a pair longer than that runs alone
    max_batched_tokens: int | None
    vision_cache_bytes: int  # vision_cache_bytes: document images' features by content

    _SETTINGS: ClassVar[dict[str, str]] = {
        "max_batch": "rerank_max_batch_size",
        "batch_wait_ms": "embed_batch_wait_ms",
        "max_model_len": "max_model_len",
        "max_batched_tokens": "max_num_batched_tokens",
        "vision_cache_bytes": "vision_cache_bytes",
    }

    @classmethod
    def from_settings(cls, settings: Settings, **changes: Any) -> RerankConfig:
        values = {name: getattr(settings, s) for name, s in cls._SETTINGS.items()}
        return replace(cls(**values), **changes)

    @classmethod
    def defaults(cls, **changes: Any) -> RerankConfig:
        return _defaults(cls, cls._SETTINGS, changes)
