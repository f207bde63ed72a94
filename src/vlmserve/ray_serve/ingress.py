"""``Ingress``: the Ray Serve deployment that serves vlmserve's HTTP API.

Each replica runs the app ``vlmserve serve`` runs (``api.app.build_app``: same routes, auth,
limits, errors, console, metrics), with one ``RayBackend`` per model deployment instead of an
in-process engine. Streams live in the session store: with ``redis_url`` set, every ingress
replica sees every stream, so a stream started through one replica resumes
(``Last-Event-ID``) and cancels through another, and a stream whose ingress replica died is
taken over by the next replica asked for it (the stored tokens are continued). Without Redis
each replica keeps its own streams: use it with one ingress replica only.

Every answer carries ``X-Vlmserve-Replica`` (this replica's Ray id), so a client or a test can
tell which replica answered. ``/health`` and ``/ready`` answer per replica as with
``vlmserve serve``; Ray's own health check fails when the app could not start.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from vlmserve.config import Settings
from vlmserve.ray_serve.backend import RayBackend
from vlmserve.ray_serve.wire import serves_of
from vlmserve.registry.manager import LifecyclePolicy, ModelHandle, ModelManager

__all__ = ["REPLICA_HEADER", "Ingress", "ReplicaHeader"]

REPLICA_HEADER = "X-Vlmserve-Replica"


class ReplicaHeader:
    """ASGI wrapper adding ``X-Vlmserve-Replica`` to every HTTP answer. Ray's proxy gives each
    request an ``X-Request-ID`` (the app echoes it) and puts it on the answer itself, so the
    app's copy is dropped: one header, not two with the same value."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        proxied_id = any(k.lower() == b"x-request-id" for k, _ in scope.get("headers", []))

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if not (proxied_id and k.lower() == b"x-request-id")
                ]
                message = {**message, "headers": [*headers, self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def ray_models(
    settings: Settings,
    handles: dict[str, DeploymentHandle],
    entries: list[dict[str, Any]] | None = None,
) -> ModelManager:
    """The ingress's model manager: every model a ``RayBackend`` over its deployment, named
    and described as its registry entry says if it has one; the registry's ``openai`` entries
    proxied from here. Models are always "loaded" here (Ray keeps their replicas up); the
    manager's keep_alive and cap are Ray's autoscaling now (``[ray.models.NAME]``)."""
    from vlmserve.registry.build import entry_handle, with_entry
    from vlmserve.registry.entries import ModelEntry

    registry = [ModelEntry.model_validate(e) for e in entries or []]
    by_name = {e.served_id: e for e in registry if e.backend == "hf"}
    model_handles = []
    for cfg in settings.model_configs():
        name = cfg.served_name
        backend = RayBackend(name, handles[name], serves_of(list(cfg.roles)))
        handle = ModelHandle(name, list(cfg.roles), backend, source=cfg.source)
        if name in by_name:
            handle = with_entry(handle, by_name[name])
        handle.keep_alive = -1
        model_handles.append(handle)
    model_handles += [entry_handle(e, settings) for e in registry if e.backend == "openai"]
    policy = LifecyclePolicy(
        on_demand=True,
        max_loaded=0,
        keep_alive=-1.0,
        eager=True,
        drain_timeout=settings.drain_timeout_seconds,
        activation_timeout=settings.activation_timeout_seconds,
    )
    return ModelManager(model_handles, policy)


@serve.ingress()
class Ingress:
    """One HTTP replica (see the module docstring); ``handles``: model name -> deployment."""

    async def __init__(
        self,
        settings: dict[str, Any],
        handles: dict[str, DeploymentHandle],
        entries: list[dict[str, Any]] | None = None,
    ):
        self.settings = Settings.model_validate(settings)
        self.handles = handles
        self.entries = entries or []  # the registry file's, read where the app was built
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.vlm_app: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        from vlmserve.api.app import build_app

        models = ray_models(self.settings, self.handles, self.entries)
        self.vlm_app = build_app(self.settings, models=models)
        return ReplicaHeader(self.vlm_app, self.replica)

    def check_health(self) -> None:
        """Unhealthy when the app hit a fatal error (Ray replaces the replica)."""
        if self.vlm_app is not None and self.vlm_app.state.fatal_error:
            raise RuntimeError(str(self.vlm_app.state.fatal_error))
