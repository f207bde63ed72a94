"""The models this server holds: resolution by name or ``role:<role>``, and loading at start-up."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from vlmserve.config import ModelConfig, Settings
from vlmserve.engine.hf.chat import HFChatBackend, ModelState
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.errors import NotFound

__all__ = ["ModelHandle", "ModelManager"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelHandle:
    name: str
    roles: list[str]
    backend: HFChatBackend
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
        return failures

    def close(self) -> None:
        for handle in self._handles.values():
            handle.backend.close()
