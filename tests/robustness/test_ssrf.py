"""SSRF through the real chat API (``image_url`` / ``video_url`` parts), default settings.

A sentinel listener is bound on 127.0.0.1 and ::1 at the port the URLs name, and an audit hook
records every ``socket.connect`` made by this process while the requests run. Pass: every URL is
a 4xx, the sentinel saw 0 connections, 0 connects happened, and no error names a resolved IP.
The redirect cases use the fetcher's own seams: a resolver that maps a public-looking name to a
public address and an ``httpx.MockTransport`` playing that public server, which answers 302.
"""

from __future__ import annotations

import re
import time
import types
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import Sentinel, leaks
from support import MODEL
from vlmserve.media import fetch
from vlmserve.media.netguard import ip_literal

pytestmark = pytest.mark.robustness

BLOCKED_HOSTS = [
    "127.0.0.1",
    "localhost",
    "localhost.",
    "LOCALHOST",
    "sub.localhost",
    "[::1]",
    "0.0.0.0",
    "2130706433",
    "0x7f000001",
    "0x7f.1",
    "0177.0.0.1",
    "127.1",
    "127.0.1",
    "[::ffff:127.0.0.1]",
    "[0:0:0:0:0:ffff:7f00:1]",
    "[::]",
    "[::127.0.0.1]",
    "[64:ff9b::7f00:1]",
    "[2002:7f00:1::]",
    "169.254.169.254",
    "[::ffff:169.254.169.254]",
    "[fd00:ec2::254]",
    "100.100.100.200",
    "10.0.0.1",
    "172.16.0.1",
    "192.168.1.1",
    "100.64.0.1",
    "[fc00::1]",
    "[fd12:3456::1]",
    "[fe80::1]",
    "[fec0::1]",
    "224.0.0.1",
    "255.255.255.255",
    "198.18.0.1",
    "192.0.0.1",
    "ip6-localhost",
    "ip6-loopback",
]
TRICKS = [
    "http://ok.test\\@127.0.0.1:{P}/a.png",
    "http://127.0.0.1:{P}#@ok.test/a.png",
    "http://ok.test@127.0.0.1:{P}/a.png",
    "http://user:pw@127.0.0.1:{P}/a.png",
    "http://127.0.0.1:{P}\t/a.png",
    "http://127.0.0.1:{P}%2f@ok.test/a.png",
    "http:/127.0.0.1:{P}/a.png",
    "http:\\\\127.0.0.1:{P}/a.png",
    "HTTP://127.0.0.1:{P}/a.png",
    "file:///etc/passwd",
    "file://localhost/etc/passwd",
    "file:///proc/self/environ",
    "/etc/passwd",
    "gopher://127.0.0.1:{P}/_GET",
    "ftp://127.0.0.1:{P}/a.png",
    "dict://127.0.0.1:{P}/",
    "ldap://127.0.0.1:{P}/",
    "jar:http://127.0.0.1:{P}/a!/b",
    "data:text/html;base64,PGgxPmhpPC9oMT4=",
    "data:application/octet-stream,abc",
]
URLS = (
    [f"http://{h}:{{P}}/a.png" for h in BLOCKED_HOSTS]
    + [f"https://{h}:{{P}}/a.png" for h in ("127.0.0.1", "[::1]", "169.254.169.254")]
    + TRICKS
)
_IP_IN_TEXT = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b")


def _chat(url: str, kind: str = "image_url") -> dict[str, Any]:
    content = [{"type": kind, kind: {"url": url}}, {"type": "text", "text": "x"}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


def _resolved_ip_leaked(url: str, message: str) -> bool:
    """An IPv4 address in the message that the client did not write (in some spelling)."""
    try:
        literal = ip_literal(urlsplit(url).hostname or "")
    except ValueError:
        literal = None
    allowed = {str(literal)} if literal is not None else set()
    return any(ip not in url and ip not in allowed for ip in _IP_IN_TEXT.findall(message))


async def test_no_media_url_reaches_an_internal_address(
    make_client: Any, sentinel: Sentinel, connect_log: list[Any]
) -> None:
    client = await make_client()
    urls = [u.replace("{P}", str(sentinel.port)) for u in URLS]
    assert len(urls) >= 40
    slowest, statuses = 0.0, {}
    for i, url in enumerate(urls):
        started = time.perf_counter()
        kind = "video_url" if i % 5 == 0 else "image_url"
        response = await client.post("/v1/chat/completions", json=_chat(url, kind))
        slowest = max(slowest, time.perf_counter() - started)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert 400 <= response.status_code < 500, (url, response.status_code, response.text)
        message = response.json()["error"]["message"]
        assert not leaks(message) and not _resolved_ip_leaked(url, message), (url, message)
    time.sleep(0.2)  # let the sentinel's accept loop notice a late connection
    print(
        f"\n{len(urls)} SSRF URLs: statuses {statuses}, slowest {slowest * 1000:.0f} ms, "
        f"sentinel hits {len(sentinel.hits)}, socket.connect calls {len(connect_log)}"
    )
    assert sentinel.hits == []
    assert connect_log == []


# -- redirects: the first hop is public, the next one is not --------------------------------

PUBLIC_IP = "93.184.216.34"


@pytest.fixture
def public_redirector(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``media.example`` resolves to a public IP; its server (a MockTransport) answers 302 to
    whatever the path says. Returns the list of URLs the fake public server was asked for."""
    asked: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        if host == "media.example":
            return [PUBLIC_IP]
        if host == "rebind.example":
            return [PUBLIC_IP, "127.0.0.1"]
        if host == "inside.example":
            return ["10.1.2.3"]
        raise OSError("no such host in this test")

    def server(request: httpx.Request) -> httpx.Response:
        asked.append(f"{request.url.host} {request.headers['host']} {request.url.path}")
        target = request.url.params.get("to", "")
        return httpx.Response(302, headers={"location": target})

    real = httpx.AsyncClient

    def client_factory(*args: Any, **kwargs: Any) -> httpx.AsyncClient:
        return real(*args, **{**kwargs, "transport": httpx.MockTransport(server)})

    patched = types.SimpleNamespace(**{**vars(httpx), "AsyncClient": client_factory})
    monkeypatch.setattr(fetch, "httpx", patched)
    monkeypatch.setattr(fetch, "system_resolver", resolver)
    return asked


async def test_redirects_to_internal_addresses_are_refused_at_every_hop(
    make_client: Any, sentinel: Sentinel, connect_log: list[Any], public_redirector: list[str]
) -> None:
    client = await make_client()
    p = sentinel.port
    targets = [
        f"http://127.0.0.1:{p}/",
        f"http://[::1]:{p}/",
        f"http://localhost:{p}/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:169.254.169.254]/",
        f"http://2130706433:{p}/",
        "http://inside.example/",
        f"http://rebind.example:{p}/",
        "file:///etc/passwd",
        f"gopher://127.0.0.1:{p}/",
        f"http://ok\\@127.0.0.1:{p}/",
    ]
    for target in targets:
        url = str(httpx.URL("http://media.example/r", params={"to": target}))
        response = await client.post("/v1/chat/completions", json=_chat(url))
        assert 400 <= response.status_code < 500, (target, response.text)
        assert "redirect" in response.json()["error"]["message"], response.text
    rebind = await client.post("/v1/chat/completions", json=_chat(f"http://rebind.example:{p}/"))
    assert rebind.status_code == 400 and "blocked" in rebind.json()["error"]["message"]
    print(
        f"\n{len(targets)} redirect targets: the public hop was asked {len(public_redirector)} "
        f"times, sentinel hits {len(sentinel.hits)}, connects {len(connect_log)}"
    )
    assert all(line.startswith(PUBLIC_IP) for line in public_redirector)
    assert len(public_redirector) == len(targets)  # exactly one request each: the public hop
    assert sentinel.hits == [] and connect_log == []
