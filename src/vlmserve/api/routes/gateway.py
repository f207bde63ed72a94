"""Routes: gateway (placeholder until they land)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["gateway"])
