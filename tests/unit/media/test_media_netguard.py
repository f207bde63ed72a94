"""Address classification and URL parsing used by the SSRF guard."""

from __future__ import annotations

import ipaddress

import pytest

from vlmserve.errors import MediaBlocked, MediaError
from vlmserve.media.netguard import ip_literal, is_public_address, parse_http_url, vet_target


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


@pytest.mark.parametrize("host", ["media.example.test", "1e100.net", "127.0.0.1 x", "", "abc"])
def test_names_are_not_ip_literals(host: str) -> None:
    assert ip_literal(host) is None


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "10.1.2.3", "172.16.5.4", "192.168.0.1", "169.254.169.254", "100.64.0.1",
        "0.0.0.0", "255.255.255.255", "224.0.0.251", "192.0.2.1", "198.51.100.7", "::", "::1",
        "fc00::1", "fd00:ec2::254", "fe80::1", "fe80::1%3", "ff02::1", "::ffff:127.0.0.1",
        "::ffff:169.254.169.254", "::127.0.0.1", "64:ff9b::10.0.0.1", "64:ff9b:1::1",
        "2002:7f00:1::", "2002:0a00:0001::", "2001::1", "2001:db8::1", "100::1",
    ],
)  # fmt: skip
def test_non_public_addresses(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address",
    [
        "93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111",
        "::ffff:93.184.216.34", "64:ff9b::93.184.216.34", "2002:5db8:d822::1",
    ],
)  # fmt: skip
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
