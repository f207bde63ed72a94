"""A worker's side of the gateway: register with ``VLMSERVE_REGISTER_URL`` on start-up.

The worker POSTs ``{"model", "url", "instance"}`` once per model it serves (``url`` is
``VLMSERVE_ADVERTISE_URL``, ``instance`` is ``VLMSERVE_INSTANCE_ID`` or the host name), retrying
with backoff while the gateway is not reachable yet. Deregistration on idle shutdown is the
watchdog's (``VLMSERVE_DEREGISTER_URL``); ``deregister`` does the same on a clean shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence

import httpx

from vlmserve.config import Settings
from vlmserve.errors import ConfigError

__all__ = ["Registration"]

log = logging.getLogger(__name__)


class Registration:
    def __init__(
        self,
        register_url: str,
        advertise_url: str,
        *,
        instance: str | None = None,
        api_key: str | None = None,
        deregister_url: str | None = None,
        attempts: int = 10,
        backoff: float = 0.5,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        for name, url in (("register_url", register_url), ("advertise_url", advertise_url)):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"VLMSERVE_{name.upper()} must be http(s)://...; got {url!r}")
        self.register_url = register_url
        self.advertise_url = advertise_url.rstrip("/")
        self.deregister_url = deregister_url or register_url.rsplit("/", 1)[0] + "/deregister"
        self.instance = instance or socket.gethostname()
        self.attempts = attempts
        self.backoff = backoff
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._key_refused = False  # the gateway answered 401/403: no further model is tried
        self._transport = transport

    @classmethod
    def from_settings(cls, settings: Settings) -> Registration | None:
        """None when the worker is not configured to register."""
        if not settings.register_url:
            return None
        if not settings.advertise_url:
            raise ConfigError(
                "VLMSERVE_REGISTER_URL is set but VLMSERVE_ADVERTISE_URL is not: give the base "
                "URL the gateway should call this worker at, e.g. http://10.0.0.5:8000"
            )
        return cls(
            settings.register_url,
            settings.advertise_url,
            instance=settings.instance_id,
            api_key=settings.gateway_key,
            deregister_url=settings.deregister_url,
        )

    async def register(self, models: Sequence[str]) -> bool:
        """Register every model; True when all were accepted. Never raises (start-up goes on).
        A refused key ends it: the same key would be refused for every other model too."""
        results = []
        for model in models:
            results.append(await self._post_retrying(self.register_url, self._body(model)))
            if self._key_refused:
                break
        return len(results) == len(models) and all(results)

    async def deregister(self, reason: str = "shutdown") -> bool:
        body = {"instance": self.instance, "reason": reason}
        return bool(await self._post(self.deregister_url, body))

    def _body(self, model: str) -> dict[str, str]:
        return {"model": model, "url": self.advertise_url, "instance": self.instance}

    async def _post_retrying(self, url: str, body: dict[str, str]) -> bool:
        delay = self.backoff
        for attempt in range(1, self.attempts + 1):
            outcome = await self._post(url, body)
            if outcome is not None:  # accepted, or refused for good (4xx: retrying won't help)
                if outcome:
                    log.info("registered %s at %s as %s", body["model"], url, self.advertise_url)
                return outcome
            if attempt < self.attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        log.error(
            "could not register %s with %s after %d attempts", body["model"], url, self.attempts
        )
        return False

    async def _post(self, url: str, body: dict[str, str]) -> bool | None:
        """True: accepted; False: refused (4xx); None: worth retrying."""
        try:
            async with httpx.AsyncClient(transport=self._transport, timeout=self.timeout) as c:
                response = await c.post(url, json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            log.warning("POST %s failed: %s", url, exc)
            return None
        if response.is_success:
            return True
        if response.status_code in (401, 403):
            self._key_refused = True
            log.error(
                "the gateway at %s refused this worker (HTTP %d): set VLMSERVE_GATEWAY_KEY on the "
                "worker to one of the gateway's VLMSERVE_ADMIN_KEYS (a gateway without admin keys "
                "accepts no worker); not retrying",
                url,
                response.status_code,
            )
            return False
        log.warning("POST %s answered %d: %s", url, response.status_code, response.text[:300])
        return None if response.status_code >= 500 or response.status_code == 429 else False
