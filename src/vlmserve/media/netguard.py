"""URL and address checks that keep media fetches off internal networks (SSRF).

The rules, applied to the first URL and again to every redirect hop:

- only ``http`` and ``https``; no userinfo (``user:pass@``), no backslash, whitespace or control
  characters in the URL (parsers disagree on those, which is how ``http://ok\\@127.0.0.1/``
  tricks work);
- the host is resolved once, IP literals in every spelling ``inet_aton`` accepts (``2130706433``,
  ``0x7f000001``, ``0177.0.0.1``, ``127.1``) are normalised first, and the fetch is refused when
  ANY address is not globally routable (see ``is_public_address``);
- the caller then connects to the vetted address, never to the name again, so a DNS answer
  that changes between check and connect (rebinding) cannot redirect the request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

from vlmserve.errors import MediaBlocked, MediaError
from vlmserve.media.policy import SETTING

__all__ = [
    "IPAddress",
    "Resolver",
    "Target",
    "ip_literal",
    "is_public_address",
    "parse_http_url",
    "shorten",
    "system_resolver",
    "vet_target",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# (host, port) -> addresses as strings; the default asks the system resolver.
Resolver = Callable[[str, int], Awaitable[list[str]]]

_NUMERIC_V4 = re.compile(r"[0-9a-fx.]+", re.IGNORECASE)
_BAD_URL_CHARS = re.compile(r"[\x00-\x20\x7f\\]")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# Not globally routable, or not a place media lives, beyond what ``ipaddress`` flags.
_BLOCKED_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
    )
)
_BLOCKED_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/96",  # unspecified, loopback, deprecated IPv4-compatible
        "::ffff:0:0/96",  # IPv4-mapped whose IPv4 part was not unwrapped
        "64:ff9b:1::/48",  # local-use NAT64
        "100::/64",  # discard-only
        "2001::/32",  # Teredo (embedded address is obfuscated)
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation (RFC 9637; Python 3.11 calls it global)
        "fc00::/7",  # unique local, includes fd00:ec2::254 (EC2 metadata)
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)


@dataclass(slots=True, frozen=True)
class Target:
    """One parsed, syntactically vetted http(s) URL."""

    url: httpx.URL
    host: str  # ASCII host to resolve and send as Host / SNI (no brackets)
    port: int
    literal: IPAddress | None  # set when the host is an IP literal (already normalised)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.url.port is None else f"{host}:{self.url.port}"


def shorten(text: str, limit: int = 120) -> str:
    """A client-sent string cut to fit an error message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def ip_literal(host: str) -> IPAddress | None:
    """The address ``host`` spells, in any form the system resolver would accept, else None."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    host = host.removesuffix(".")
    if not host or not _NUMERIC_V4.fullmatch(host):
        return None
    try:  # accepts decimal, hex, octal and short forms: 2130706433, 0x7f.1, 0177.0.0.1, 127.1
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public_address(ip: IPAddress) -> bool:
    """True only for globally routable unicast addresses (IPv6 forms judged by embedded IPv4)."""
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ipaddress.IPv6Address(ip.compressed.split("%", 1)[0])  # drop any scope id
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return is_public_address(embedded)
        if any(ip in net for net in _BLOCKED_V6) or ip.is_site_local:
            return False
    elif any(ip in net for net in _BLOCKED_V4):
        return False
    flags = (ip.is_private, ip.is_loopback, ip.is_link_local, ip.is_multicast, ip.is_reserved)
    return ip.is_global and not ip.is_unspecified and not any(flags)


def parse_http_url(raw: str, *, what: str = "media URL") -> Target:
    """Parse and syntactically vet an http(s) URL; raise MediaBlocked/MediaError otherwise."""
    shown = shorten(raw)
    if _BAD_URL_CHARS.search(raw):
        raise MediaBlocked(
            f"{what} {shown!r} contains whitespace, control characters or a "
            "backslash; percent-encode them"
        )
    try:
        parts = urlsplit(raw)
    except ValueError:
        raise MediaError(f"{what} {shown!r} is not a valid URL") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaBlocked(f"{what} {shown!r} uses a scheme other than http or https")
    if "@" in parts.netloc:
        raise MediaBlocked(
            f"{what} {shown!r} contains credentials (user@host); they are not allowed in media URLs"
        )
    try:
        hostname, port = parts.hostname, parts.port
    except ValueError:
        raise MediaError(f"{what} {shown!r} has an invalid port") from None
    if not hostname:
        raise MediaError(f"{what} {shown!r} has no host")
    literal = ip_literal(hostname)
    if literal is not None:  # rewrite odd spellings so every later parser sees one address
        host = f"[{literal}]" if literal.version == 6 else str(literal)
        raw = urlunsplit(parts._replace(netloc=host if port is None else f"{host}:{port}"))
    try:
        url = httpx.URL(raw)
    except (httpx.InvalidURL, ValueError, UnicodeError):
        raise MediaError(f"{what} {shown!r} is not a valid URL") from None
    if url.userinfo or url.scheme not in ("http", "https") or not url.raw_host:
        raise MediaBlocked(f"{what} {shown!r} is not a plain http(s) URL")
    default_port = 443 if url.scheme == "https" else 80
    host = url.raw_host.decode("ascii")
    return Target(url=url, host=host, port=url.port or default_port, literal=literal)


def _blocked(what: str, url: str) -> MediaBlocked:
    return MediaBlocked(
        f"{what} {shorten(url)!r} is blocked: its host is, or resolves to, a private, loopback, "
        "link-local or otherwise non-public address; media URLs must point to public hosts (set "
        f"{SETTING['allow_private_networks']}=true only for trusted internal deployments)"
    )


async def vet_target(
    target: Target, *, allow_private: bool, resolver: Resolver, what: str = "media URL"
) -> IPAddress:
    """Resolve ``target`` and return the address to connect to; refuse non-public ones."""
    shown = str(target.url)
    if target.literal is not None:
        addresses: list[IPAddress] = [target.literal]
    else:
        name = target.host.lower().removesuffix(".")
        if not allow_private and (name == "localhost" or name.endswith(".localhost")):
            raise _blocked(what, shown)
        try:
            answers = await resolver(target.host, target.port)
        except (OSError, UnicodeError):
            raise MediaError(f"could not resolve the host of {what} {shorten(shown)!r}") from None
        try:
            addresses = [ipaddress.ip_address(a) for a in answers]
        except ValueError:
            raise _blocked(what, shown) from None
        if not addresses:
            raise MediaError(f"could not resolve the host of {what} {shorten(shown)!r}")
    if not allow_private and not all(is_public_address(a) for a in addresses):
        raise _blocked(what, shown)
    return addresses[0]
