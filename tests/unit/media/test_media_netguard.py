"""Address classification and URL parsing used by the SSRF guard."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import pytest

from vlmserve.errors import MediaBlocked, MediaError
from vlmserve.media import netguard
from vlmserve.media.netguard import (
    ip_literal,
    is_public_address,
    parse_http_url,
    shorten,
    system_resolver,
    vet_target,
)


@pytest.mark.parametrize(
    ("spelling", "address"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("0x7f000001", "127.0.0.1"),
        ("0X7F000001", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("127.0.0.1.", "127.0.0.1"),
        ("0", "0.0.0.0"),
        ("[::1]", "::1"),
        ("::ffff:127.0.0.1", "::ffff:7f00:1"),
    ],
)
def test_ip_literal_normalises_every_spelling(spelling: str, address: str) -> None:
    assert ip_literal(spelling) == ipaddress.ip_address(address)


@pytest.mark.parametrize(
    "host", ["media.example.test", "1e100.net", "127.0.0.1 x", "", "abc", "0x7f000001X", "[1]x"]
)
def test_names_are_not_ip_literals(host: str) -> None:
    assert ip_literal(host) is None


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.5.4",
        "192.168.0.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "255.255.255.255",
        "224.0.0.251",
        "192.0.2.1",
        "198.51.100.7",
        "::",
        "::1",
        "fc00::1",
        "fd00:ec2::254",
        "fe80::1",
        "fe80::1%3",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "::127.0.0.1",
        "64:ff9b::10.0.0.1",
        "64:ff9b:1::1",
        "2002:7f00:1::",
        "2002:0a00:0001::",
        "2001::1",
        "2001:db8::1",
        "100::1",
    ],
)
def test_non_public_addresses(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address",
    [
        "93.184.216.34",
        "8.8.8.8",
        "1.1.1.1",
        "2606:4700:4700::1111",
        "::ffff:93.184.216.34",
        "64:ff9b::93.184.216.34",
        "2002:5db8:d822::1",
    ],
)
def test_public_addresses_including_embedded_public_ipv4(address: str) -> None:
    assert is_public_address(ipaddress.ip_address(address))


def test_parse_keeps_name_port_and_path() -> None:
    target = parse_http_url("https://Media.Example.test:8443/a/b.png?x=1")
    assert (target.host, target.port, target.literal) == ("media.example.test", 8443, None)
    assert target.host_header == "media.example.test:8443"
    assert target.url.raw_path == b"/a/b.png?x=1"


def test_parse_default_ports_and_idna() -> None:
    assert parse_http_url("http://bücher.test/x").host == "xn--bcher-kva.test"
    assert parse_http_url("https://media.example.test/").port == 443
    assert parse_http_url("http://media.example.test:80/").host_header == "media.example.test"


def test_parse_rewrites_odd_ip_spellings_to_one_canonical_address() -> None:
    target = parse_http_url("http://0177.0.0.1:81/x")
    assert str(target.literal) == "127.0.0.1"
    assert (target.url.host, target.url.port) == ("127.0.0.1", 81)
    assert parse_http_url("http://[::1]:81/").host_header == "[::1]:81"


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("http://u:p@h.test/", MediaBlocked),
        ("http://h.test\\@1.2.3.4/", MediaBlocked),
        ("http://h.test /", MediaBlocked),
        ("ftp://h.test/", MediaBlocked),
        ("http:///nohost", MediaError),
        ("http://h.test:99999/", MediaError),
        ("http://[::1/", MediaError),
    ],
)
def test_parse_rejects(url: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_http_url(url)


async def test_vet_target_fails_closed_on_an_empty_answer() -> None:
    async def nothing(host: str, port: int) -> list[str]:
        return []

    with pytest.raises(MediaError, match="could not resolve"):
        await vet_target(parse_http_url("http://a.test/"), allow_private=False, resolver=nothing)


async def test_vet_target_passes_the_port_to_the_resolver() -> None:
    seen: list[tuple[str, int]] = []

    async def record(host: str, port: int) -> list[str]:
        seen.append((host, port))
        return ["93.184.216.34"]

    target = parse_http_url("https://a.test/")
    assert str(await vet_target(target, allow_private=False, resolver=record)) == "93.184.216.34"
    assert seen == [("a.test", 443)]


# -- every block-list entry, with an address Python alone would not always refuse ------------

BLOCK_LIST_EXAMPLES = {
    "0.0.0.0/8": "0.1.2.3",
    "10.0.0.0/8": "10.255.255.254",
    "100.64.0.0/10": "100.127.255.254",
    "127.0.0.0/8": "127.255.255.254",
    "169.254.0.0/16": "169.254.0.1",
    "172.16.0.0/12": "172.31.255.254",
    "192.0.0.0/24": "192.0.0.9",
    "192.0.2.0/24": "192.0.2.255",
    "192.88.99.0/24": "192.88.99.1",
    "192.168.0.0/16": "192.168.255.254",
    "198.18.0.0/15": "198.19.255.254",
    "198.51.100.0/24": "198.51.100.255",
    "203.0.113.0/24": "203.0.113.255",
    "224.0.0.0/4": "239.255.255.250",
    "240.0.0.0/4": "240.0.0.1",
    "::/96": "::2",
    "::ffff:0:0/96": "::ffff:7f00:1",
    "64:ff9b:1::/48": "64:ff9b:1::808:808",
    "100::/64": "100::1",
    "2001::/32": "2001:0:4136:e378:8000:63bf:3fff:fdd2",
    "2001:db8::/32": "2001:db8:ffff::1",
    "3fff::/20": "3fff:fff::1",
    "fc00::/7": "fdff::1",
    "fe80::/10": "febf::1",
    "fec0::/10": "feff::1",
    "ff00::/8": "ff0e::1",
}


@pytest.mark.parametrize(("network", "address"), BLOCK_LIST_EXAMPLES.items())
def test_every_blocked_range_is_refused(network: str, address: str) -> None:
    assert ipaddress.ip_address(address) in ipaddress.ip_network(network)
    assert not is_public_address(ipaddress.ip_address(address))


def test_the_block_list_examples_cover_every_block_list_entry() -> None:
    assert {str(n) for n in (*netguard._BLOCKED_V4, *netguard._BLOCKED_V6)} == set(
        BLOCK_LIST_EXAMPLES
    )


@pytest.mark.parametrize("address", ["4000::1", "fe00::1", "200::1", "5f00::1", "::1.2.3.4"])
def test_reserved_ipv6_space_that_python_calls_global_is_refused(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert ip.is_global  # so only the guard's own checks stand between it and a fetch
    assert not is_public_address(ip)


@pytest.mark.parametrize("address", ["2606:4700:4700::1111%eth0", "fd00::1%1", "fe80::1%eth0"])
def test_a_scope_id_does_not_change_the_verdict(address: str) -> None:
    plain = ipaddress.ip_address(address.partition("%")[0])
    assert is_public_address(ipaddress.ip_address(address)) == is_public_address(plain)


# -- the system resolver ------------------------------------------------------------------


async def test_system_resolver_asks_for_the_host_and_port_as_tcp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[object, ...]] = []

    async def getaddrinfo(host: str, port: int, **kw: object) -> list[tuple[object, ...]]:
        seen.append((host, port, kw))
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", getaddrinfo)
    assert await system_resolver("media.example.test", 8443) == ["93.184.216.34"]
    assert seen == [("media.example.test", 8443, {"type": socket.SOCK_STREAM})]


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700:4700::1111"])
async def test_system_resolver_returns_the_address_a_public_literal_names_once(
    address: str,
) -> None:
    assert await system_resolver(address, 443) == [address]


# -- vet_target ---------------------------------------------------------------------------


class Resolver:
    """A fake resolver: every name answers ``answers``; records what it was asked."""

    def __init__(self, *answers: str, error: Exception | None = None) -> None:
        self.answers, self.error, self.asked = list(answers), error, []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.error is not None:
            raise self.error
        return self.answers


@pytest.mark.parametrize(
    "host", ["localhost", "LocalHost", "localhost.", "sub.localhost", "a.b.LOCALHOST."]
)
async def test_localhost_names_are_refused_without_asking_the_resolver(host: str) -> None:
    resolver = Resolver("93.184.216.34")
    with pytest.raises(MediaBlocked, match="is blocked"):
        await vet_target(parse_http_url(f"http://{host}/"), allow_private=False, resolver=resolver)
    assert resolver.asked == []


async def test_localhost_goes_to_the_resolver_when_private_networks_are_allowed() -> None:
    resolver = Resolver("127.0.0.1")
    target = parse_http_url("http://localhost:8080/")
    assert str(await vet_target(target, allow_private=True, resolver=resolver)) == "127.0.0.1"
    assert resolver.asked == [("localhost", 8080)]


async def test_names_that_only_end_in_localhost_letters_are_resolved() -> None:
    resolver = Resolver("93.184.216.34")
    target = parse_http_url("http://notlocalhost/")
    assert str(await vet_target(target, allow_private=False, resolver=resolver)) == "93.184.216.34"


async def test_a_name_is_refused_when_any_of_its_addresses_is_internal() -> None:
    resolver = Resolver("93.184.216.34", "10.0.0.1")
    with pytest.raises(MediaBlocked) as caught:
        await vet_target(parse_http_url("http://a.test/x"), allow_private=False, resolver=resolver)
    message = str(caught.value)
    assert message.startswith("media URL 'http://a.test/x' is blocked: its host is, or resolves to")
    assert message.endswith(
        "private, loopback, link-local or otherwise non-public address; media URLs must point to "
        "public hosts (set VLMSERVE_MEDIA_ALLOW_PRIVATE_NETWORKS=true only for trusted internal "
        "deployments)"
    )
    assert "10.0.0.1" not in message  # never tell the client what a name resolved to
    assert caught.value.code == "media_url_blocked"


async def test_the_first_vetted_address_is_the_one_to_connect_to() -> None:
    resolver = Resolver("93.184.216.34", "1.1.1.1")
    target = parse_http_url("http://a.test/")
    assert str(await vet_target(target, allow_private=False, resolver=resolver)) == "93.184.216.34"


async def test_private_answers_pass_when_private_networks_are_allowed() -> None:
    resolver = Resolver("10.0.0.1", "93.184.216.34")
    target = parse_http_url("http://a.test/")
    assert str(await vet_target(target, allow_private=True, resolver=resolver)) == "10.0.0.1"


async def test_ip_literals_are_vetted_without_the_resolver() -> None:
    resolver = Resolver("93.184.216.34")
    with pytest.raises(MediaBlocked, match="is blocked"):
        await vet_target(parse_http_url("http://10.0.0.1/"), allow_private=False, resolver=resolver)
    loopback, public = parse_http_url("http://[::1]/"), parse_http_url("http://8.8.8.8/")
    allowed = await vet_target(loopback, allow_private=True, resolver=resolver)
    public = await vet_target(public, allow_private=False, resolver=resolver)
    assert (str(allowed), str(public)) == ("::1", "8.8.8.8")
    assert resolver.asked == []


@pytest.mark.parametrize("error", [OSError("no such host"), UnicodeError("label too long")])
async def test_a_resolver_failure_is_a_media_error_not_a_crash(error: Exception) -> None:
    resolver = Resolver(error=error)
    with pytest.raises(MediaError) as caught:
        await vet_target(parse_http_url("http://a.test/"), allow_private=True, resolver=resolver)
    assert str(caught.value) == "could not resolve the host of media URL 'http://a.test/'"
    assert caught.value.code == "invalid_media"


async def test_a_resolver_answer_that_is_not_an_address_is_refused() -> None:
    resolver = Resolver("93.184.216.34", "not-an-address")
    with pytest.raises(MediaBlocked, match=r"^media URL 'http://a\.test/' is blocked"):
        await vet_target(parse_http_url("http://a.test/"), allow_private=True, resolver=resolver)


async def test_vet_target_names_what_it_refused() -> None:
    target = parse_http_url("http://10.0.0.1/")
    with pytest.raises(MediaBlocked, match=r"^video URL 'http://10\.0\.0\.1/' is blocked"):
        await vet_target(target, allow_private=False, resolver=Resolver(), what="video URL")
    name = parse_http_url("http://a.test/")
    with pytest.raises(MediaError, match=r"^could not resolve the host of video URL"):
        await vet_target(name, allow_private=False, resolver=Resolver(), what="video URL")


# -- parse_http_url and shorten -------------------------------------------------------------


def test_http_default_port_is_80_and_schemes_are_case_insensitive() -> None:
    assert parse_http_url("http://media.example.test/").port == 80
    assert parse_http_url("HTTPS://media.example.test/").port == 443
    assert parse_http_url("HTTP://media.example.test/").host_header == "media.example.test"


def test_odd_ip_spellings_without_a_port_are_rewritten_too() -> None:
    target = parse_http_url("http://0x7f.1/a.png")
    assert (str(target.url), target.port) == ("http://127.0.0.1/a.png", 80)
    v6 = parse_http_url("http://[0:0:0:0:0:0:0:1]/")
    assert (str(v6.url), v6.host, v6.host_header) == ("http://[::1]/", "::1", "[::1]")


def test_parse_errors_name_a_media_url_by_default() -> None:
    with pytest.raises(MediaBlocked, match=r"^media URL 'ftp://h\.test/' uses a scheme"):
        parse_http_url("ftp://h.test/")


@pytest.mark.parametrize(
    ("url", "error", "message"),
    [
        ("http://u:p@h.test/", MediaBlocked, "'http://u:p@h.test/' contains credentials (user@"),
        ("http://h.test\\x/", MediaBlocked, "contains whitespace, control characters or a back"),
        ("ftp://h.test/", MediaBlocked, "'ftp://h.test/' uses a scheme other than http or https"),
        ("http:///nohost", MediaError, "'http:///nohost' has no host"),
        ("http://h.test:99999/", MediaError, "'http://h.test:99999/' has an invalid port"),
        ("http://[::1/", MediaError, "'http://[::1/' is not a valid URL"),
        ("http://☃.test/", MediaError, "'http://☃.test/' is not a valid URL"),
    ],
)
def test_parse_errors_say_what_is_wrong(url: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        parse_http_url(url, what="image URL")
    assert str(caught.value).startswith("image URL ")
    assert message in str(caught.value)


def test_shorten_keeps_120_characters_and_marks_the_cut() -> None:
    assert shorten("a" * 120) == "a" * 120
    assert shorten("a" * 121) == "a" * 117 + "..."
    assert shorten("abcdef", limit=5) == "ab..."
