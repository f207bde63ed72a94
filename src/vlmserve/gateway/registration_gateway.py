"""The gateway side of registration: workers join and leave the replica pools of the
server's proxied models (``openai`` registry entries).

The server's models come in as ``Models``, the little of ``registry.ModelManager`` this needs,
so the gateway package does not import the registry (the registry builds gateway backends).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from vlmserve.engine.protocol import Backend, as_proxied
from vlmserve.errors import InvalidRequest

__all__ = ["Models", "deregister_replica", "register_replica", "replica_state"]


class ModelRef(Protocol):
    """A served model as the registry holds it (``registry.ModelHandle``)."""

    @property
    def name(self) -> str: ...

    @property
    def backend(self) -> Backend: ...


class Models(Protocol):
    """The server's models (``registry.ModelManager``)."""

    @property
    def handles(self) -> Sequence[ModelRef]: ...

    def resolve(self, name: str) -> ModelRef: ...

    def state(self) -> list[dict[str, Any]]: ...


async def register_replica(models: Models, model: str, url: str, instance: str) -> dict[str, Any]:
    """Add (or refresh) a replica of ``model``; it gets traffic once health and preflight
    pass. One instance serves one URL: a worker that moved to another model leaves the old."""
    handle = models.resolve(model)
    backend = as_proxied(handle.backend)
    if backend is None or not backend.accepts_replicas:
        raise InvalidRequest(
            f"model {handle.name!r} is a {handle.backend.kind} entry, not an openai (upstream) "
            'entry; replicas register only with `backend = "openai"` entries of the '
            "gateway's registry",
            param="model",
            code="not_an_upstream",
        )
    for other in models.handles:
        if other is not handle and (proxied := as_proxied(other.backend)) is not None:
            proxied.remove_replica(instance)
    replica = await backend.add_replica(url, instance)
    return {"model": handle.name, **replica}


def deregister_replica(models: Models, instance: str) -> list[str]:
    """Remove the instance's replicas everywhere; returns the models it served."""
    return [
        h.name
        for h in models.handles
        if (backend := as_proxied(h.backend)) is not None and backend.remove_replica(instance)
    ]


def replica_state(models: Models) -> list[dict[str, Any]]:
    """Every proxied model and its replicas: health, ejection, load, why it is out."""
    return [{"model": m["name"], **m["upstream"]} for m in models.state() if "upstream" in m]
