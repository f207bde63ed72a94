"""http(s) fetches: SSRF policy, pinning, redirects, size and time limits (MockTransport)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from vlmserve.errors import MediaBlocked, MediaError, PayloadTooLarge
from vlmserve.media import MediaPolicy, read_source

GOOD_IP = "93.184.216.34"
BODY = b"\x89PNG\r\n\x1a\n" + b"x" * 100
HOSTS = {
    "media.example.test": [GOOD_IP],
    "cdn.example.test": ["93.184.216.35"],
    "v6.example.test": ["2606:2800:220:1:248:1893:25c8:1946"],
    "evil.example.test": ["127.0.0.1"],
    "meta.example.test": ["169.254.169.254"],
    "mixed.example.test": [GOOD_IP, "10.0.0.1"],
    "v6meta.example.test": ["fd00:ec2::254"],
    "mapped.example.test": ["::ffff:169.254.169.254"],
    "lan6.example.test": ["fe80::1%2"],
    "garbage.example.test": ["not-an-ip"],
}
POLICY = MediaPolicy(max_bytes=1000, fetch_timeout=2.0)


async def resolver(host: str, port: int) -> list[str]:
    try:
        return list(HOSTS[host])
    except KeyError:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None


class Recorder:
    """A MockTransport handler that records every request that reached the transport."""

    def __init__(self, respond: Callable[[httpx.Request], httpx.Response] | None = None):
        self.requests: list[httpx.Request] = []
        self.respond = respond or (lambda request: httpx.Response(200, content=BODY))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.respond(request)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self))


async def fetch(url: str, recorder: Recorder, policy: MediaPolicy = POLICY) -> bytes:
    async with recorder.client() as client:
        return await read_source(url, policy, kind="image", client=client, resolver=resolver)


BLOCKED = [
    # loopback, every spelling
    "http://127.0.0.1/a.png",
    "http://127.0.0.2/",
    "http://127.255.255.254/",
    "https://127.0.0.1/",
    "http://127.0.0.1:8080/",
    "http://2130706433/",
    "http://0x7f000001/",
    "http://0177.0.0.1/",
    "http://0x7f.1/",
    "http://127.1/",
    "http://127.0.0.1./",
    "HTTP://127.0.0.1/",
    "  http://127.0.0.1/  ",
    "http://[::1]/",
    "http://[0:0:0:0:0:0:0:1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:7f00:1]/",
    "http://[0:0:0:0:0:ffff:127.0.0.1]/",
    "http://localhost/",
    "http://LOCALHOST./",
    "http://app.localhost/",
    # unspecified
    "http://0.0.0.0/",
    "http://0/",
    "http://[::]/",
    # cloud metadata, v4 and IPv6 forms
    "http://169.254.169.254/latest/meta-data/",
    "http://2852039166/",
    "http://0xa9fea9fe/",
    "http://[::ffff:169.254.169.254]/",
    "http://[::ffff:a9fe:a9fe]/",
    "http://[fd00:ec2::254]/",
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://[2002:a9fe:a9fe::1]/",
    # RFC 1918, CGNAT, other special ranges
    "http://10.0.0.1/",
    "http://10.255.255.255/",
    "http://172.16.0.1/",
    "http://172.31.255.255/",
    "http://192.168.1.1/",
    "http://100.64.0.1/",
    "http://100.127.255.254/",
    "http://198.18.0.1/",
    "http://224.0.0.1/",
    "http://255.255.255.255/",
    "http://240.0.0.1/",
    # IPv6 private ranges
    "http://[fc00::1]/",
    "http://[fd12:3456::1]/",
    "http://[fe80::1]/",
    "http://[fec0::1]/",
    "http://[ff02::1]/",
    "http://[2001:db8::1]/",
    "http://[2001:0:4136:e378::1]/",
    # names that resolve to blocked addresses (any of them)
    "http://evil.example.test/",
    "http://meta.example.test/x",
    "http://mixed.example.test/",
    "http://v6meta.example.test/",
    "http://mapped.example.test/",
    "http://lan6.example.test/",
    "http://garbage.example.test/",
    # credentials and parser-confusion tricks
    "http://user:pass@media.example.test/",
    "http://media.example.test@127.0.0.1/",
    "http://ok.test\\@127.0.0.1/",
    "http://127.0.0.1\\@media.example.test/",
    "http://media.example.test\\.127.0.0.1/",
    "http://127.0.0.1\t/",
    "http://127.0.0.1%0a/",
    "http://:@127.0.0.1/",
    # other schemes
    "file:///etc/passwd",
    "file://localhost/etc/passwd",
    "gopher://127.0.0.1:70/_x",
    "ftp://media.example.test/a.png",
    "dict://127.0.0.1:11211/",
    "ws://media.example.test/",
    "jar:http://media.example.test/a.zip!/",
    "netdoc:///etc/passwd",
]


def test_the_blocklist_is_large() -> None:
    assert len(BLOCKED) >= 40


@pytest.mark.parametrize("url", BLOCKED)
async def test_blocked_url_never_reaches_the_transport(url: str) -> None:
    recorder = Recorder()
    with pytest.raises((MediaBlocked, MediaError)) as info:
        await fetch(url, recorder)
    assert recorder.requests == []
    if "%0a" not in url:  # an undecodable host is a plain MediaError; everything else is blocked
        assert isinstance(info.value, MediaBlocked), info.value.message


async def test_blocked_message_names_the_setting_and_hides_resolved_addresses() -> None:
    with pytest.raises(MediaBlocked) as info:
        await fetch("http://evil.example.test/a.png", Recorder())
    assert "VLMSERVE_MEDIA_ALLOW_PRIVATE_NETWORKS" in info.value.message
    assert "127.0.0.1" not in info.value.message


async def test_good_url_is_pinned_to_the_vetted_ip_with_host_header_kept() -> None:
    recorder = Recorder()
    assert await fetch("http://media.example.test/cat.png?size=2", recorder) == BODY
    (request,) = recorder.requests
    assert request.url.host == GOOD_IP
    assert request.url.raw_path == b"/cat.png?size=2"
    assert request.headers["host"] == "media.example.test"
    assert "sni_hostname" not in request.extensions


async def test_https_keeps_the_real_name_for_tls_and_non_default_port_in_host() -> None:
    recorder = Recorder()
    await fetch("https://media.example.test:8443/cat.png", recorder)
    (request,) = recorder.requests
    assert (request.url.scheme, request.url.host, request.url.port) == ("https", GOOD_IP, 8443)
    assert request.headers["host"] == "media.example.test:8443"
    assert request.extensions["sni_hostname"] == "media.example.test"


async def test_ipv6_answer_is_pinned_in_brackets() -> None:
    recorder = Recorder()
    await fetch("http://v6.example.test/a.png", recorder)
    (request,) = recorder.requests
    assert request.url.host == "2606:2800:220:1:248:1893:25c8:1946"
    assert request.headers["host"] == "v6.example.test"


async def test_public_ip_literal_in_odd_spelling_is_normalised() -> None:
    recorder = Recorder()
    await fetch("http://1572395042/a.png", recorder)  # 93.184.216.34 as one decimal number
    assert recorder.requests[0].url.host == GOOD_IP


async def test_private_networks_are_reachable_when_policy_allows() -> None:
    recorder = Recorder()
    policy = MediaPolicy(allow_private_networks=True)
    assert await fetch("http://evil.example.test/a.png", recorder, policy) == BODY
    assert recorder.requests[0].url.host == "127.0.0.1"


def redirecting(chain: dict[str, str]) -> Callable[[httpx.Request], httpx.Response]:
    """Serve 302s keyed by path; anything else gets BODY."""

    def respond(request: httpx.Request) -> httpx.Response:
        location = chain.get(request.url.path)
        if location is not None:
            return httpx.Response(302, headers={"Location": location})
        return httpx.Response(200, content=BODY)

    return respond


async def test_redirect_chain_is_followed_and_each_hop_is_pinned() -> None:
    chain = {"/a": "http://cdn.example.test/b", "/b": "/c"}
    recorder = Recorder(redirecting(chain))
    assert await fetch("http://media.example.test/a", recorder) == BODY
    hops = [(r.url.host, r.url.path, r.headers["host"]) for r in recorder.requests]
    assert hops == [
        (GOOD_IP, "/a", "media.example.test"),
        ("93.184.216.35", "/b", "cdn.example.test"),
        ("93.184.216.35", "/c", "cdn.example.test"),
    ]


@pytest.mark.parametrize(
    "location",
    [
        "http://127.0.0.1/secret",
        "http://169.254.169.254/latest/meta-data/",
        "http://evil.example.test/",
        "http://[::ffff:10.0.0.1]/",
        "http://user:pw@cdn.example.test/",
        "http://ok.test\\@127.0.0.1/",
        "file:///etc/passwd",
        "gopher://127.0.0.1/",
        "//127.0.0.1/scheme-relative",
    ],
)
async def test_redirect_to_blocked_target_is_refused_before_any_request(location: str) -> None:
    recorder = Recorder(redirecting({"/a": location}))
    with pytest.raises(MediaBlocked) as info:
        await fetch("http://media.example.test/a", recorder)
    assert [r.url.host for r in recorder.requests] == [GOOD_IP]  # only the first hop was sent
    assert "redirect" in info.value.message


async def test_redirect_limit() -> None:
    chain = {"/1": "/2", "/2": "/3", "/3": "/4"}
    recorder = Recorder(redirecting(chain))
    with pytest.raises(MediaError, match=r"more than 2 redirects \(VLMSERVE_MEDIA_MAX_REDIRECTS\)"):
        await fetch("http://media.example.test/1", recorder, MediaPolicy(max_redirects=2))
    assert len(recorder.requests) == 3
    recorder = Recorder(redirecting(chain))
    assert await fetch("http://media.example.test/1", recorder, MediaPolicy(max_redirects=3))


async def test_error_status_names_the_status() -> None:
    recorder = Recorder(lambda request: httpx.Response(404, content=b"nope"))
    with pytest.raises(MediaError, match="HTTP 404"):
        await fetch("http://media.example.test/missing.png", recorder)


async def test_content_length_over_the_limit_is_refused_before_reading() -> None:
    recorder = Recorder(lambda r: httpx.Response(200, headers={"Content-Length": "5000"}))
    with pytest.raises(PayloadTooLarge, match=r"5000 bytes.*1000 bytes.*VLMSERVE_MAX_MEDIA_BYTES"):
        await fetch("http://media.example.test/big.png", recorder)


async def test_streamed_body_is_cut_at_the_limit() -> None:
    sent: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        for i in range(1000):
            sent.append(i)
            yield b"z" * 100

    recorder = Recorder(lambda request: httpx.Response(200, content=endless()))
    with pytest.raises(PayloadTooLarge, match="VLMSERVE_MAX_MEDIA_BYTES"):
        await fetch("http://media.example.test/stream.png", recorder)
    assert len(sent) <= 12


async def test_body_at_exactly_the_limit_is_accepted() -> None:
    recorder = Recorder(lambda request: httpx.Response(200, content=b"y" * 1000))
    assert len(await fetch("http://media.example.test/a.png", recorder)) == 1000


async def test_empty_body_is_an_error() -> None:
    recorder = Recorder(lambda request: httpx.Response(200, content=b""))
    with pytest.raises(MediaError, match="empty"):
        await fetch("http://media.example.test/a.png", recorder)


async def test_slow_server_times_out_with_the_setting_named() -> None:
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(10)
        return httpx.Response(200, content=BODY)

    started = time.monotonic()
    async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
        with pytest.raises(
            MediaError, match=r"timed out after 0.2s \(VLMSERVE_MEDIA_FETCH_TIMEOUT\)"
        ):
            await read_source(
                "http://media.example.test/a.png",
                MediaPolicy(fetch_timeout=0.2),
                kind="image",
                client=client,
                resolver=resolver,
            )
    assert time.monotonic() - started < 2


async def test_slow_body_counts_against_the_same_timeout() -> None:
    async def drip() -> AsyncIterator[bytes]:
        for _ in range(100):
            await asyncio.sleep(0.05)
            yield b"d"

    recorder = Recorder(lambda request: httpx.Response(200, content=drip()))
    with pytest.raises(MediaError, match="timed out"):
        await fetch("http://media.example.test/a.png", recorder, MediaPolicy(fetch_timeout=0.3))


async def test_slow_resolver_counts_against_the_timeout() -> None:
    async def slow_resolver(host: str, port: int) -> list[str]:
        await asyncio.sleep(10)
        return [GOOD_IP]

    with pytest.raises(MediaError, match="timed out"):
        await read_source(
            "http://media.example.test/a.png",
            MediaPolicy(fetch_timeout=0.2),
            kind="image",
            resolver=slow_resolver,
        )


async def test_unresolvable_host_is_a_media_error() -> None:
    with pytest.raises(MediaError, match="could not resolve"):
        await fetch("http://nowhere.example.test/a.png", Recorder())


async def test_transport_failure_is_a_media_error_without_internal_details() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused to 93.184.216.34")

    with pytest.raises(MediaError) as info:
        await fetch("http://media.example.test/a.png", Recorder(refuse))
    assert "ConnectError" in info.value.message
    assert GOOD_IP not in info.value.message


async def test_default_client_is_used_when_none_given_and_still_blocks() -> None:
    with pytest.raises(MediaBlocked):
        await read_source("http://127.0.0.1:9/", POLICY, kind="video")


async def test_system_resolver_answers_ip_literals_without_network() -> None:
    from vlmserve.media.netguard import system_resolver

    assert "127.0.0.1" in await system_resolver("127.0.0.1", 80)
