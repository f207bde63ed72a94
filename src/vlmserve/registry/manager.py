"""The models this server holds: resolution by name or ``role:<role>``, and loading at start-up."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from vlmserve.config import ModelConfig, Settings
from vlmserve.engine.hf.chat import HFChatBackend
from vlmserve.engine.hf.embed import HFEmbedBackend
from vlmserve.engine.hf.lifecycle import ModelState
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.errors import InvalidRequest, NotFound

Backend = HFChatBackend | HFEmbedBackend
EMBEDDING = "embedding"

__all__ = ["ModelHandle", "ModelManager"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelHandle:
    name: str
    roles: list[str]
    backend: Backend
    source: str = ""
    aliases: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.backend.state is ModelState.READY


def _handle(cfg: ModelConfig, settings: Settings) -> ModelHandle:
    options = LoadOptions(
        source=cfg.source,
        device=cfg.device or settings.device,
        dtype=cfg.dtype or settings.dtype,
        attn_implementation=settings.attn_implementation,
        trust_remote_code=settings.trust_remote_code,
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
    )
    backend: Backend
    if EMBEDDING in cfg.roles:
        backend = HFEmbedBackend(cfg.served_name, options, adapter=cfg.adapter)
    else:
        backend = HFChatBackend(
            cfg.served_name,
            options,
            max_model_len=settings.max_model_len,
            max_queued=settings.max_queued_requests,
        )
    return ModelHandle(
        name=cfg.served_name, roles=list(cfg.roles), backend=backend, source=cfg.source
    )


class ModelManager:
    def __init__(self, handles: list[ModelHandle]):
        self._handles = {h.name: h for h in handles}

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelManager:
        return cls([_handle(cfg, settings) for cfg in settings.model_configs()])

    @property
    def handles(self) -> list[ModelHandle]:
        return list(self._handles.values())

    @property
    def ready(self) -> bool:
        return bool(self._handles) and all(h.ready for h in self._handles.values())

    def resolve(self, name: str, role: str = "chat") -> ModelHandle:
        """A model by served name, source, alias, or ``role:<role>``; 404 lists what exists."""
        if name.startswith("role:"):
            role = name.removeprefix("role:")
            found = [h for h in self._handles.values() if role in h.roles]
            if found:
                return found[0]
        for h in self._handles.values():
            if name in (h.name, h.source, *h.aliases):
                return h
        available = ", ".join(sorted(self._handles)) or "none"
        raise NotFound(
            f"model {name!r} does not exist on this server; available: {available}",
            param="model",
            code="model_not_found",
        )

    def for_role(self, role: str, name: str | None = None) -> ModelHandle:
        """The model named ``name``, else the first (non-deprecated) one with ``role``."""
        if name:
            return self.resolve(name)
        found = [h for h in self._handles.values() if role in h.roles]
        if not found and role != "chat" and role != EMBEDDING:
            found = [h for h in self._handles.values() if "chat" in h.roles]
        if not found:
            raise NotFound(
                f'no model with role {role!r} on this server; give one `roles = ["{role}"]` '
                "in the [[models]] config",
                param="model",
                code="model_not_found",
            )
        return found[0]

    def chat(self, name: str | None, role: str = "chat") -> HFChatBackend:
        handle = self.resolve(name) if name else self.for_role(role)
        if not isinstance(handle.backend, HFChatBackend):
            raise InvalidRequest(
                f"model {handle.name!r} is an embedding model; use /v1/embeddings or "
                "/encode-text and /encode-video with it",
                param="model",
                code="wrong_model_kind",
            )
        return handle.backend

    def embedder(self, name: str | None) -> HFEmbedBackend:
        handle = self.resolve(name) if name else self.for_role(EMBEDDING)
        if not isinstance(handle.backend, HFEmbedBackend):
            raise InvalidRequest(
                f"model {handle.name!r} is not an embedding model; give an embedding model "
                '(roles = ["embedding"])',
                param="model",
                code="wrong_model_kind",
            )
        return handle.backend

    async def load_all(self) -> list[str]:
        """Load every model, one after another, off the event loop. Failures are logged, kept
        in each model's state (``/health`` reports them) and returned as messages."""
        failures = []
        for handle in self._handles.values():
            if handle.ready:
                continue
            try:
                await asyncio.to_thread(handle.backend.load)
            except Exception as exc:
                log.error("model %s failed to load: %s", handle.name, exc)
                failures.append(f"model {handle.name!r} failed to load: {exc}")
                continue
            log.info(
                "model %s (%s) ready in %.1fs, holding %.1f MiB",
                handle.name,
                ", ".join(handle.roles),
                handle.backend.load_seconds or 0.0,
                handle.backend.memory_bytes / 2**20,
            )
        return failures

    def close(self) -> None:
        for handle in self._handles.values():
            handle.backend.close()
