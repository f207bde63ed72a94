"""Gateway: workers add and remove themselves as replicas of ``openai`` registry entries.

``POST /v1/gateway/register {model, url, instance}`` adds (or refreshes) a replica; it gets
traffic once its health check and preflight pass. ``POST /v1/gateway/deregister {instance,
reason}`` removes it: the body is exactly what a worker's idle watchdog sends before it shuts
down (``VLMSERVE_DEREGISTER_URL``). All three routes are admin routes (``api/auth.py``): a
replica receives the gateway's traffic and the replica list shows upstream URLs and process
ids, so they need an admin key of the gateway (a worker sends ``VLMSERVE_GATEWAY_KEY``) and
answer 403 while the gateway has no admin keys.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from vlmserve.api.endpoints.gateway.protocol import DeregisterRequest, RegisterRequest
from vlmserve.api.routing import StrictJSONRoute
from vlmserve.api.services import ModelsDep
from vlmserve.gateway.registration_gateway import (
    deregister_replica,
    register_replica,
    replica_state,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/gateway", tags=["gateway"], route_class=StrictJSONRoute)


@router.post("/register")
async def register(models: ModelsDep, body: RegisterRequest) -> dict[str, Any]:
    """Add the worker at ``url`` as a replica of ``model`` (an openai entry)."""
    replica = await register_replica(models, body.model, body.url, body.instance)
    return {"object": "gateway.replica", "registered": True, **replica}


@router.post("/deregister")
async def deregister(models: ModelsDep, body: DeregisterRequest) -> dict[str, Any]:
    """Remove every replica of ``instance`` (unknown instances are not an error: idempotent)."""
    served = deregister_replica(models, body.instance)
    return {"object": "gateway.replica", "instance": body.instance, "deregistered": served}


@router.get("/replicas")
async def replicas(models: ModelsDep) -> dict[str, Any]:
    """Every proxied model and its replicas: health, ejection, load, why it is out."""
    return {"models": replica_state(models)}
