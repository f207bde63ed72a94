"""Preflight: is this OpenAI-compatible server ready for a tagger?

Checks, in order, each timed and each with a detail that says what went wrong:

    models        GET /v1/models answers; ``model`` is listed (else the first listed is taken)
    text_chat     a text-only chat completion is 200 with at least one choice
    vision_chat   a chat with a 1x1 PNG (data URL) is 200 with at least one choice
    embeddings    POST /v1/embeddings gives a vector, where /v1/models says the model embeds
                  (``capabilities`` or ``roles`` in its entry); skipped, with a note, otherwise

A check that cannot run because an earlier one failed is *skipped*, never reported as passed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from vlmserve.client.http import describe_failure, error_text, normalize_base_url, open_client
from vlmserve.client.media import data_url, pixel_png

__all__ = ["CHECKS", "CheckResult", "PreflightReport", "embeds", "run_preflight"]

CHECKS = ("models", "text_chat", "vision_chat", "embeddings")


@dataclass(slots=True)
class CheckResult:
    name: str
    ok: bool | None  # None = skipped
    latency_ms: float
    detail: str

    @property
    def status(self) -> str:
        return "skip" if self.ok is None else ("ok" if self.ok else "FAIL")


@dataclass(slots=True)
class PreflightReport:
    url: str
    model: str | None
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No check failed (skipped ones don't count against it)."""
        return all(c.ok is not False for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.ok is False]

    def to_dict(self) -> dict[str, Any]:
        checks = [{**asdict(c), "status": c.status} for c in self.checks]
        return {
            "url": self.url,
            "model": self.model,
            "ok": self.ok,
            "failed": self.failed,
            "checks": checks,
        }


async def run_preflight(
    base_url: str,
    model: str | None = None,
    *,
    api_key: str | None = None,
    timeout: float = 30.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> PreflightReport:
    """Run every check against ``base_url``; never raises for a server fault (it is reported)."""
    report = PreflightReport(url=normalize_base_url(base_url), model=model)
    async with open_client(base_url, api_key=api_key, timeout=timeout, transport=transport) as c:
        probe = _Probe(c, report.url, timeout)
        entry = await probe.models(report)
        if probe.unreachable or report.model is None:
            why = "server unreachable" if probe.unreachable else "no model to ask"
            _skip(report, ["text_chat", "vision_chat", "embeddings"], f"{why} (see models)")
            return report
        roles = set(entry.get("roles") or []) if entry else set()
        if roles and roles <= {"embedding", "rerank"}:
            kind = "embedding-only" if roles == {"embedding"} else "embedding or rerank"
            _skip(report, ["text_chat", "vision_chat"], f"{kind} model: no chat role")
        else:
            report.checks.append(await probe.chat(report.model, vision=False))
            report.checks.append(await probe.chat(report.model, vision=True))
        report.checks.append(await probe.embeddings(report.model, entry))
    return report


def _skip(report: PreflightReport, names: list[str], why: str) -> None:
    report.checks.extend(CheckResult(name, None, 0.0, why) for name in names)


def embeds(entry: dict[str, Any] | None) -> bool | None:
    """Whether a /v1/models entry says the model makes embeddings; None when it doesn't say."""
    if not entry:
        return None
    caps = entry.get("capabilities")
    if isinstance(caps, dict) and "embedding" in caps:
        return bool(caps["embedding"])
    if isinstance(caps, list):
        return "embedding" in caps
    roles = entry.get("roles")
    if isinstance(roles, list):
        return "embedding" in roles
    return None


def _pick(listed: list[dict[str, Any]], model: str) -> dict[str, Any] | None:
    """The entry that serves ``model``: by id, by alias (where listed) or ``role:NAME``."""
    for entry in listed:
        if model == entry.get("id") or model in (entry.get("aliases") or []):
            return entry
    if model.startswith("role:"):
        role = model.removeprefix("role:")
        return next((e for e in listed if role in (e.get("roles") or [])), None)
    return None


class _Probe:
    """One timed HTTP call per check; turns every outcome into a ``CheckResult``."""

    def __init__(self, client: httpx.AsyncClient, url: str, timeout: float):
        self.client, self.url, self.timeout = client, url, timeout
        self.unreachable = False  # a transport failure: later checks would only repeat it

    async def _timed(
        self, name: str, call: Callable[[], Awaitable[httpx.Response]]
    ) -> tuple[httpx.Response | None, CheckResult]:
        started = time.perf_counter()
        try:
            response = await call()
        except httpx.HTTPError as exc:
            self.unreachable = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
            ms = (time.perf_counter() - started) * 1000
            return None, CheckResult(name, False, ms, describe_failure(exc, self.url, self.timeout))
        ms = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            return None, CheckResult(
                name, False, ms, error_text(response.status_code, response.content)
            )
        return response, CheckResult(name, True, ms, "")

    async def models(self, report: PreflightReport) -> dict[str, Any] | None:
        response, result = await self._timed("models", lambda: self.client.get("/v1/models"))
        report.checks.append(result)
        if response is None:
            return None
        listed = [e for e in _json(response).get("data") or [] if isinstance(e, dict)]
        ids = [str(e.get("id")) for e in listed]
        if report.model is None:
            if not listed:
                result.ok, result.detail = False, "the server lists no models"
                return None
            report.model = ids[0]
            result.detail = f"{len(ids)} listed; using the first: {ids[0]}"
            return listed[0]
        entry = _pick(listed, report.model)
        if entry is None:
            result.ok = False
            result.detail = f"model {report.model!r} is not listed; listed: {', '.join(ids) or '-'}"
            return None
        result.detail = f"{report.model!r} listed ({len(ids)} in all)"
        return entry

    async def chat(self, model: str, *, vision: bool) -> CheckResult:
        content: Any = "Reply with one word: ready?"
        if vision:
            image = {"type": "image_url", "image_url": {"url": data_url(pixel_png(), "image/png")}}
            content = [image, {"type": "text", "text": "What colour is this pixel?"}]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0,
        }
        name = "vision_chat" if vision else "text_chat"
        call = lambda: self.client.post("/v1/chat/completions", json=body)  # noqa: E731
        response, result = await self._timed(name, call)
        if response is None:
            return result
        choices = _json(response).get("choices")
        if not isinstance(choices, list) or not choices:
            result.ok, result.detail = False, "200 but no choices in the answer"
            return result
        first = choices[0] if isinstance(choices[0], dict) else {}
        text = str((first.get("message") or {}).get("content") or "")
        result.detail = f"finish_reason={first.get('finish_reason')} text={text[:40]!r}"
        return result

    async def embeddings(self, model: str, entry: dict[str, Any] | None) -> CheckResult:
        capable = embeds(entry)
        if not capable:
            why = "no embedding capability" if capable is False else "capability not advertised"
            return CheckResult("embeddings", None, 0.0, f"skipped: {why} in /v1/models")
        body = {"model": model, "input": "preflight"}
        call = lambda: self.client.post("/v1/embeddings", json=body)  # noqa: E731
        response, result = await self._timed("embeddings", call)
        if response is None:
            return result
        data = _json(response).get("data")
        vector = data[0].get("embedding") if isinstance(data, list) and data else None
        if not vector:
            result.ok, result.detail = False, "200 but no embedding in the answer"
        else:
            result.detail = f"dimension {len(vector)}" if isinstance(vector, list) else "base64"
        return result


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
