"""Registry entries served by proxy (``openai``, ``vllm``): their backends, and how the manager
loads, unloads and matches any backend (in-process loads run off the event loop)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from vlmserve.config import Settings
from vlmserve.engine.hf.embed import HFEmbedBackend
from vlmserve.engine.routing import PoolPolicy
from vlmserve.engine.supervisor import Supervisor, SupervisorConfig
from vlmserve.engine.upstream import UpstreamBackend, UpstreamConfig
from vlmserve.engine.vllm import VllmBackend
from vlmserve.errors import ConfigError
from vlmserve.registry.entries import ModelEntry, VllmConfig

__all__ = ["fits", "load_backend", "unload_backend", "upstream_backend"]


def upstream_backend(
    entry: ModelEntry, settings: Settings, transport: Any = None
) -> UpstreamBackend:
    """The proxy backend of an ``openai`` or ``vllm`` registry entry."""
    cfg = entry.upstream_config()
    api_key = cfg.api_key
    if cfg.api_key_env:
        api_key = os.environ.get(cfg.api_key_env)
        if not api_key:
            raise ConfigError(f"model {entry.name!r}: environment variable {cfg.api_key_env} "
                              "(backend_config.api_key_env) is not set")  # fmt: skip
    limits = entry.limits.max_queued_requests or settings.max_queued_requests
    config = UpstreamConfig(
        model=entry.served_id, base_urls=getattr(cfg, "urls", []),
        connect_timeout=cfg.timeouts.connect, read_timeout=cfg.timeouts.read, api_key=api_key,
        health_interval=settings.upstream_health_interval, preflight=cfg.preflight,
        embedding=entry.capabilities.embedding,
        policy=PoolPolicy(max_failures=settings.upstream_max_failures,
                          eject_seconds=settings.upstream_eject_seconds,
                          max_queued=limits, max_concurrency=cfg.max_concurrency),
    )  # fmt: skip
    if not isinstance(cfg, VllmConfig):
        return UpstreamBackend(entry.name, config, transport=transport)
    supervisor = Supervisor(SupervisorConfig(
        entry.name, cfg.command, env=cfg.env, health_timeout=cfg.health_timeout,
        stop_timeout=cfg.stop_timeout, log_dir=cfg.log_dir,
    ))  # fmt: skip
    return VllmBackend(entry.name, config, supervisor, transport=transport)


def fits(backend: Any, kind: type) -> bool:
    """A backend serves requests meant for ``kind`` (an upstream by its embedding flag)."""
    if isinstance(backend, UpstreamBackend):
        return backend.embedding == (kind is HFEmbedBackend)
    return isinstance(backend, kind)


async def load_backend(backend: Any) -> None:
    if isinstance(backend, UpstreamBackend):
        await backend.aload()
    else:
        await asyncio.to_thread(backend.load)


async def unload_backend(backend: Any) -> None:
    if isinstance(backend, UpstreamBackend):
        await backend.aclose()
    else:
        await asyncio.to_thread(backend.close)
