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

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from vlmserve.api.routing import StrictJSONRoute

__all__ = ["router"]

router = APIRouter(prefix="/v1/gateway", tags=["gateway"], route_class=StrictJSONRoute)


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=512)
    url: str = Field(min_length=1, max_length=2048)
    instance: str = Field(min_length=1, max_length=256)

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("url must be the worker's base URL, http(s)://host:port")
        return url


class DeregisterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    instance: str = Field(min_length=1, max_length=256)
    reason: str | None = Field(default=None, max_length=256)


@router.post("/register")
async def register(request: Request, body: RegisterRequest) -> dict[str, Any]:
    """Add the worker at ``url`` as a replica of ``model`` (an openai entry)."""
    replica = await request.app.state.models.register_replica(body.model, body.url, body.instance)
    return {"object": "gateway.replica", "registered": True, **replica}


@router.post("/deregister")
async def deregister(request: Request, body: DeregisterRequest) -> dict[str, Any]:
    """Remove every replica of ``instance`` (unknown instances are not an error: idempotent)."""
    models = request.app.state.models.deregister_replica(body.instance)
    return {"object": "gateway.replica", "instance": body.instance, "deregistered": models}


@router.get("/replicas")
async def replicas(request: Request) -> dict[str, Any]:
    """Every proxied model and its replicas: health, ejection, load, why it is out."""
    return {
        "models": [
            {"model": m["name"], **m["upstream"]}
            for m in request.app.state.models.state()
            if "upstream" in m
        ]
    }
