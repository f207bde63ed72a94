"""Settings and registry entries -> model handles: the one module that names the concrete
backend classes (``hf`` chat and embedding in process, ``openai`` upstreams, ``vllm``
subprocesses). Everything else talks to them through ``engine.protocol.Backend``."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from vlmserve.config import ModelConfig, Settings
from vlmserve.engine.configs import ChatEngineConfig, EmbedConfig, LoadOptions, RerankConfig
from vlmserve.engine.hf.templates import read_chat_template
from vlmserve.engine.outputs import check_parser_names
from vlmserve.engine.proc import EngineProcClient
from vlmserve.engine.protocol import Backend
from vlmserve.engine.types import Serves
from vlmserve.errors import ConfigError
from vlmserve.gateway.pool import PoolPolicy
from vlmserve.gateway.supervisor import Supervisor, SupervisorConfig
from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig
from vlmserve.gateway.vllm import VllmBackend
from vlmserve.media.workers.pool import default_workers
from vlmserve.registry.entries import ModelEntry, VllmConfig
from vlmserve.registry.handles import ModelHandle

__all__ = [
    "build_handles",
    "chat_backend",
    "entry_handle",
    "hf_backend",
    "hf_handle",
    "upstream_backend",
    "with_entry",
]


def load_options(cfg: ModelConfig, settings: Settings) -> LoadOptions:
    return LoadOptions(
        source=cfg.source,
        device=cfg.device or settings.device,
        dtype=cfg.dtype or settings.dtype,
        attn_implementation=settings.attn_implementation,
        trust_remote_code=settings.trust_remote_code,
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
        chat_template=_template(cfg.chat_template or settings.chat_template),
    )


def _template(value: str | None) -> str | None:
    return read_chat_template(value) if value is not None else None


def hf_backend(cfg: ModelConfig, settings: Settings) -> Backend:
    """An in-process model: an embedding model for the ``embedding`` role, a cross-encoder
    for the ``rerank`` role, else chat; ``chat`` and ``rerank`` together: one chat model
    that also scores (one copy of the weights, one vision cache).

    The backends (torch, transformers) are imported where one is built: the API process of
    a server whose chat models run in engine processes never imports them (about 10 s of
    CPU and 700 MiB less at start-up), nor does a Ray ingress replica."""
    options = load_options(cfg, settings)
    roles = set(cfg.roles)
    rerank = Serves.RERANK.value in roles and Serves.EMBEDDING.value not in roles
    if rerank and Serves.CHAT.value not in roles:
        from vlmserve.engine.hf.score.backend import HFRerankBackend

        return HFRerankBackend(
            cfg.served_name, options, config=RerankConfig.from_settings(settings)
        )
    if Serves.EMBEDDING.value in cfg.roles:
        from vlmserve.engine.hf.embed import HFEmbedBackend

        return HFEmbedBackend(
            cfg.served_name,
            options,
            adapter=cfg.adapter,
            config=EmbedConfig.from_settings(settings),
        )
    config = ChatEngineConfig.from_settings(
        settings,
        reasoning_parser=cfg.reasoning_parser or settings.reasoning_parser,
        tool_call_parser=cfg.tool_call_parser or settings.tool_call_parser,
        **_per_model(cfg),
    )
    check_parser_names(config.reasoning_parser, config.tool_call_parser)
    scores = RerankConfig.from_settings(settings) if rerank else None
    if settings.engine_process:
        workers = settings.media_workers
        workers = default_workers() if workers is None else workers
        config = replace(config, preprocess_workers=workers)  # images off the engine's GIL
        return EngineProcClient(
            cfg.served_name,
            partial(chat_backend, cfg.served_name, options, config, scores=scores),
            media_nice=config.media_nice,
            scores=rerank,
        )
    return chat_backend(cfg.served_name, options, config, scores=scores)


def chat_backend(
    name: str, options: LoadOptions, config: ChatEngineConfig, scores: RerankConfig | None
) -> Backend:
    """The in-process chat backend; an engine process calls it (pickled by name) to build the
    model it serves."""
    from vlmserve.engine.hf.chat import HFChatBackend

    return HFChatBackend(name, options, config, scores=scores)


def _per_model(cfg: ModelConfig) -> dict[str, Any]:
    """The engine settings a ``[[models]]`` table (or registry entry) sets for its model."""
    changes: dict[str, Any] = {}
    if cfg.kv_cache_memory is not None:
        changes["kv_cache_bytes"] = cfg.kv_cache_memory
    if cfg.enable_prefix_caching is not None:
        changes["prefix_caching"] = cfg.enable_prefix_caching
    return changes


def hf_handle(cfg: ModelConfig, settings: Settings) -> ModelHandle:
    return ModelHandle(
        name=cfg.served_name,
        roles=list(cfg.roles),
        backend=hf_backend(cfg, settings),
        source=cfg.source,
        keep_alive=cfg.keep_alive,
    )


def _api_key(entry: ModelEntry, key: str | None, env: str | None) -> str | None:
    if not env:
        return key
    value = os.environ.get(env)
    if not value:
        raise ConfigError(
            f"model {entry.name!r}: environment variable {env} "
            "(backend_config.api_key_env) is not set"
        )
    return value


def upstream_backend(entry: ModelEntry, settings: Settings) -> Backend:
    """The proxy backend of an ``openai`` or ``vllm`` registry entry."""
    cfg = entry.upstream_config()
    limits = entry.limits.max_queued_requests or settings.max_queued_requests
    config = UpstreamConfig(
        model=entry.served_id,
        base_urls=getattr(cfg, "urls", []),
        connect_timeout=cfg.timeouts.connect,
        read_timeout=cfg.timeouts.read,
        api_key=_api_key(entry, cfg.api_key, cfg.api_key_env),
        health_interval=settings.upstream_health_interval,
        preflight=cfg.preflight,
        embedding=entry.capabilities.embedding,
        rerank="rerank" in entry.roles and not entry.capabilities.embedding,
        chat="chat" in entry.roles,
        policy=PoolPolicy(
            max_failures=settings.upstream_max_failures,
            eject_seconds=settings.upstream_eject_seconds,
            max_queued=limits,
            max_concurrency=cfg.max_concurrency,
        ),
    )
    if not isinstance(cfg, VllmConfig):
        return UpstreamBackend(entry.name, config)
    supervisor = Supervisor(
        SupervisorConfig(
            entry.name,
            cfg.command,
            env=cfg.env,
            health_timeout=cfg.health_timeout,
            stop_timeout=cfg.stop_timeout,
            log_dir=cfg.log_dir,
        )
    )
    return VllmBackend(entry.name, config, supervisor)


def entry_handle(entry: ModelEntry, settings: Settings) -> ModelHandle:
    """A registry entry's handle: hf in process, openai/vllm proxied."""
    if entry.backend != "hf":
        handle = ModelHandle(entry.name, list(entry.roles), upstream_backend(entry, settings))
    else:
        handle = hf_handle(entry.to_model_config(), settings)
    return with_entry(handle, entry)


def with_entry(handle: ModelHandle, entry: ModelEntry) -> ModelHandle:
    """``handle`` named, aged and described as the registry entry says."""
    handle.aliases = entry.identifiers
    handle.keep_alive = entry.keep_alive
    handle.capabilities = frozenset(entry.capabilities.enabled())
    handle.deprecated = entry.deprecated
    return handle


def registry_handles(settings: Settings) -> list[ModelHandle]:
    """Handles for the registry file's entries: hf in process, openai/vllm proxied."""
    from vlmserve.registry.files import load_registry

    if not settings.registry:
        return []
    discovered = Path(settings.registry_discovered) if settings.registry_discovered else None
    registry = load_registry(Path(settings.registry), discovered)
    return [entry_handle(entry, settings) for entry in registry.entries]


def build_handles(settings: Settings) -> list[ModelHandle]:
    """Every model the settings name: ``--model``/``[[models]]``, then the registry's."""
    handles = [hf_handle(cfg, settings) for cfg in settings.model_configs()]
    return handles + registry_handles(settings)
