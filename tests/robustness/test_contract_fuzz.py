"""Contract fuzzing: schemathesis walks the app's own OpenAPI schema, every operation, against a
real uvicorn server sharing the loaded tiny model.

Pass: 0 responses >= 500, 0 response-schema / content-type / header violations, 0 hangs (every
call has a 10 s limit), and no body leaks a traceback, an address or a server path. Because the
operations come from ``app.openapi()``, routes added later (the gateway's) are fuzzed as soon as
they exist. Generation stays cheap: ``max_tokens`` defaults to 8 and the context is 64 tokens.

The limits are set low (``LIMITS``: upload size, stored bytes per key, unfinished batches per
key, media per request, generations per key), so fuzzed calls run into them; and
``test_each_limit_answers_its_documented_4xx`` drives each one on purpose, checking the
answer against the schema as the fuzzer does.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import Scale, leaks  # tests/robustness/conftest.py (a plain import of helpers)
from vlmserve.api.app import build_app
from vlmserve.config import Settings

pytestmark = pytest.mark.robustness

ADMIN = {"Authorization": "Bearer fuzz-admin"}
CHEAP = {
    "max_tokens": 8,
    "max_model_len": 64,
    "admin_keys": ["fuzz-admin"],
    "api_keys": ["fuzz-user"],
    "media_fetch_timeout": 2.0,
}
# The bounds a request meets before work, set low so that the fuzzer reaches them.
LIMITS = {
    "files_max_bytes": 4096,
    "files_quota_bytes": 8192,
    "batch_max_unfinished": 1,
    "max_media_per_request": 2,
    "max_concurrent_per_key": 2,
}
CALL_TIMEOUT = 10.0


def _schema_dict() -> dict[str, Any]:
    return build_app(Settings()).openapi()


SCHEMA = schemathesis.openapi.from_dict(_schema_dict())
OPERATIONS = [r.ok() for r in SCHEMA.get_all_operations()]


def _guard(case: Any) -> None:
    """Never let the fuzzer unload the model the whole test session shares."""
    body = case.body if isinstance(case.body, dict) else {}
    if case.operation.path == "/admin/deactivate" and body.get("model") in ("tiny", "role:chat"):
        case.body["model"] = "not-the-shared-model"


def _check(case: Any, response: Any, found: dict[str, list[str]]) -> None:
    label = f"{case.method} {case.formatted_path}"
    if response.status_code >= 500:
        found["5xx"].append(f"{label} -> {response.status_code} for body {case.body!r:.400}")
    bad = leaks(response.text)
    if bad:
        found["leak"].append(f"{label}: {bad} in {response.text[:300]}")
    checks = [content_type_conformance, response_schema_conformance, response_headers_conformance]
    try:
        case.validate_response(response, checks=checks)
    except FailureGroup as exc:
        found["schema"].append(f"{label}: {exc}"[:800])
    try:
        case.validate_response(response, checks=[status_code_conformance])
    except FailureGroup:
        found["undocumented_status"].append(f"{label} -> {response.status_code}")


def _fuzz(op: Any, mode: GenerationMode, base: str, n: int, found: dict, stats: Counter) -> None:
    session = requests.Session()

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        _guard(case)
        started = time.monotonic()
        try:
            response = case.call(
                base_url=base, session=session, headers=ADMIN, timeout=CALL_TIMEOUT
            )
        except requests.Timeout:
            found["hang"].append(f"{case.method} {case.formatted_path}")
            return
        stats[response.status_code] += 1
        stats["slowest_ms"] = max(stats["slowest_ms"], int(1000 * (time.monotonic() - started)))
        _check(case, response, found)

    try:
        run()
    except Unsatisfiable:  # nothing to negate (no parameters, no body): positive mode covers it
        assert mode is GenerationMode.NEGATIVE
    finally:
        session.close()


@pytest.mark.parametrize("op", OPERATIONS, ids=[o.label for o in OPERATIONS])
def test_operation_never_5xx_never_violates_its_schema(
    op: Any, live_server: Any, scale: Scale, record_property: Any
) -> None:
    server = live_server(**CHEAP, **LIMITS)
    found: dict[str, list[str]] = {
        k: [] for k in ("5xx", "schema", "hang", "leak", "undocumented_status")
    }
    stats: Counter = Counter()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        _fuzz(op, mode, server.url, scale.fuzz_examples, found, stats)
    calls = sum(v for k, v in stats.items() if isinstance(k, int))
    record_property("calls", calls)
    record_property("statuses", dict(stats))
    undocumented = Counter(s.rsplit(" ", 1)[-1] for s in found["undocumented_status"])
    print(f"\n{op.label}: {calls} calls, statuses {dict(stats)}, undocumented {dict(undocumented)}")
    assert calls > 0
    assert found["5xx"] == [], found["5xx"][:5]
    assert found["hang"] == [], found["hang"][:5]
    assert found["leak"] == [], found["leak"][:5]
    assert found["schema"] == [], found["schema"][:3]
    assert found["undocumented_status"] == [], found["undocumented_status"][:5]


def _operation(method: str, path: str) -> Any:
    return next(o for o in OPERATIONS if o.method.upper() == method and o.path == path)


def _documented(
    method: str, path: str, response: Any, media_type: str = "application/json"
) -> None:
    """A 4xx in OpenAI's error shape that the schema documents for the operation."""
    case = _operation(method, path).Case(media_type=media_type)
    checks = [content_type_conformance, response_schema_conformance, status_code_conformance]
    case.validate_response(response, checks=checks)
    assert 400 <= response.status_code < 500, response.text[:300]
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_each_limit_answers_its_documented_4xx(live_server: Any) -> None:
    base = live_server(**CHEAP, **LIMITS).url
    http = requests.Session()
    http.headers.update({"Authorization": "Bearer fuzz-user"})

    def upload(data: bytes, purpose: str = "batch") -> Any:
        files = {"file": ("in.jsonl", data)}
        return http.post(f"{base}/v1/files", files=files, data={"purpose": purpose}, timeout=30)

    too_big = upload(b"x" * 4097)
    _documented("POST", "/v1/files", too_big, "multipart/form-data")
    assert too_big.status_code == 413 and "VLMSERVE_FILES_MAX_BYTES" in too_big.text
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    }
    data = (json.dumps(line) + "\n").encode()
    file_id = upload(data).json()["id"]
    create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        answer = http.post(f"{base}/v1/batches", json={**create, "metadata": metadata}, timeout=30)
        _documented("POST", "/v1/batches", answer)
        assert answer.status_code == 400, answer.text[:300]
    first = http.post(f"{base}/v1/batches", json=create, timeout=30)
    assert first.status_code == 200, first.text[:300]
    second = http.post(f"{base}/v1/batches", json=create, timeout=30)
    _documented("POST", "/v1/batches", second)
    assert second.json()["error"]["code"] == "batch_quota_exceeded"
    while (over := upload(b"y" * 4000)).status_code == 200:
        pass  # the quota fills
    _documented("POST", "/v1/files", over, "multipart/form-data")
    assert over.json()["error"]["code"] == "files_quota_exceeded"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": [image] * 3}]}
    answer = http.post(f"{base}/v1/chat/completions", json=chat, timeout=30)
    _documented("POST", "/v1/chat/completions", answer)
    assert "VLMSERVE_MAX_MEDIA_PER_REQUEST" in answer.text
    parts = [{"type": "input_image", "file_id": file_id}] * 3
    responses = {"model": "tiny", "input": [{"role": "user", "content": parts}]}
    answer = http.post(f"{base}/v1/responses", json=responses, timeout=30)
    _documented("POST", "/v1/responses", answer)
    assert "VLMSERVE_MAX_MEDIA_PER_REQUEST" in answer.text
    long_text = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]}
    answer = http.post(f"{base}/v1/chat/completions", json=long_text, timeout=30)
    _documented("POST", "/v1/chat/completions", answer)
    http.post(f"{base}/v1/batches/{first.json()['id']}/cancel", timeout=30)
    http.close()
    over_cap = _over_the_key_cap(base, LIMITS["max_concurrent_per_key"])
    _documented("POST", "/v1/chat/completions", over_cap)
    assert over_cap.status_code == 429 and int(over_cap.headers["retry-after"]) >= 1
    assert over_cap.json()["error"]["code"] == "key_concurrency_limit"


def _over_the_key_cap(base: str, cap: int, bursts: int = 3) -> Any:
    """The 429 of one key's generation past its cap: bursts of ``cap + 4`` chats at once (each
    of them 200 or 429, none a 5xx), until one is over."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"max_tokens": 40, "ignore_eos": True, "temperature": 0}

    def one(_: int) -> Any:
        headers = {"Authorization": "Bearer fuzz-user"}
        return requests.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)

    for _ in range(bursts):
        with ThreadPoolExecutor(cap + 4) as pool:
            answers = list(pool.map(one, range(cap + 4)))
        assert {a.status_code for a in answers} <= {200, 429}, [a.text[:200] for a in answers]
        assert sum(a.status_code == 200 for a in answers) >= cap
        refused = [a for a in answers if a.status_code == 429]
        if refused:
            return refused[0]
    raise AssertionError(f"{bursts} bursts of {cap + 4} chats of one key: none refused")
