"""Read the bytes of one media item from wherever the client says it is.

Accepted sources, checked in this order:

- ``data:<mime>[;base64],<payload>`` URLs (the mime must fit the kind: image/* or video/*);
- ``http://`` / ``https://`` URLs, fetched under the SSRF rules of ``netguard`` with the
  connection pinned to the vetted address, redirects followed by hand and re-checked per hop;
- absolute paths and ``file://`` URLs, only inside ``MediaPolicy.allowed_local_roots``;
- any other ``scheme:`` is refused; everything else is read as raw base64.

Sizes are checked before work: base64 text longer than ``max_bytes`` can encode is refused
before decoding, downloads check ``Content-Length`` and then count streamed bytes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
import os
import re
import stat
from typing import Literal
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlsplit

import httpx

from vlmserve.errors import MediaBlocked, MediaError, PayloadTooLarge
from vlmserve.media.netguard import (
    IPAddress,
    Resolver,
    Target,
    parse_http_url,
    shorten,
    system_resolver,
    vet_target,
)
from vlmserve.media.policy import SETTING, MediaPolicy

__all__ = ["MediaKind", "read_source"]

MediaKind = Literal["image", "video"]

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_URLSAFE = str.maketrans("-_", "+/")
_ASCII_SPACE = "".join(c for c in map(chr, range(128)) if c.isspace())  # what str.split drops
_PATH_MAX = 4096
_USER_AGENT = "vlmserve-media-fetch"


async def read_source(
    source: str,
    policy: MediaPolicy,
    *,
    kind: MediaKind,
    client: httpx.AsyncClient | None = None,
    resolver: Resolver | None = None,
) -> bytes:
    """The raw bytes of one image or video; raises MediaError, MediaBlocked or PayloadTooLarge."""
    if len(source) > 2 * _max_base64_len(policy) + _PATH_MAX:  # cheap bound before any copying
        raise _too_large(kind, policy)
    text = source.strip()
    if not text:
        raise MediaError(f"the {kind} source is empty")
    scheme_match = _SCHEME.match(text)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    if scheme == "data":
        return _read_data_url(text, policy, kind)
    if scheme in ("http", "https"):
        return await _fetch_http(text, policy, client, resolver or system_resolver)
    if scheme == "file" or _looks_like_path(text):
        return await asyncio.to_thread(_read_local, text, policy)
    if scheme:
        raise MediaBlocked(
            f"{kind} source {shorten(text)!r} uses the unsupported scheme {scheme!r}; "
            "use http(s) URLs, data: URLs or base64"
        )
    return _decode_base64(text, policy, kind)


# -- data: URLs and base64 -------------------------------------------------------------------


def _max_base64_len(policy: MediaPolicy) -> int:
    return 4 * math.ceil(policy.max_bytes / 3)


def _too_large(kind: str, policy: MediaPolicy, size: int | None = None) -> PayloadTooLarge:
    what = f"the {kind} is {size} bytes" if size is not None else f"the {kind} is too large"
    return PayloadTooLarge(
        f"{what}; the limit is {policy.max_bytes} bytes per media item ({SETTING['max_bytes']})"
    )


def _read_data_url(text: str, policy: MediaPolicy, kind: MediaKind) -> bytes:
    header, comma, payload = text[len("data:") :].partition(",")
    if not comma:
        raise MediaError(f"the {kind} data: URL has no ',' before its payload")
    params = [p.strip().lower() for p in header.split(";")]
    mime = params[0]
    if not mime.startswith(f"{kind}/"):
        shown = mime or "text/plain (none given)"
        raise MediaError(
            f"the {kind} data: URL has media type {shorten(shown, 60)!r}; expected {kind}/*"
        )
    if "base64" in params[1:]:
        return _decode_base64(payload, policy, kind)
    if len(payload) > 3 * policy.max_bytes:  # each byte takes 1 to 3 characters
        raise _too_large(kind, policy)
    data = unquote_to_bytes(payload)
    if len(data) > policy.max_bytes:
        raise _too_large(kind, policy, len(data))
    if not data:
        raise MediaError(f"the {kind} data: URL is empty")
    return data


def _without_space(text: str) -> str:
    if text.isascii() and not any(c in text for c in _ASCII_SPACE):
        return text  # the usual case: no copy
    return "".join(text.split())


def _decode_base64(text: str, policy: MediaPolicy, kind: str) -> bytes:
    """Standard or URL-safe base64, padding optional, whitespace ignored; size-checked first."""
    limit = _max_base64_len(policy)
    if len(text) > 2 * limit + _PATH_MAX:
        raise _too_large(kind, policy)
    # each scan below is a fast search; the copies they avoid cost ~0.5 ms per MB
    compact = _without_space(text)
    if len(compact) > limit:
        raise _too_large(kind, policy, len(compact.rstrip("=")) * 3 // 4)
    if "-" in compact or "_" in compact:
        compact = compact.translate(_URLSAFE)
    compact = compact.rstrip("=")
    if not compact:
        raise MediaError(f"the {kind} base64 data is empty")
    if len(compact) % 4 == 1:
        raise MediaError(f"the {kind} is not valid base64 (its length is impossible)")
    try:
        data = base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(
            f"the {kind} is not valid base64, a data: URL, an http(s) URL or an absolute path"
        ) from None
    if len(data) > policy.max_bytes:
        raise _too_large(kind, policy, len(data))
    return data


# -- local files -----------------------------------------------------------------------------


def _looks_like_path(text: str) -> bool:
    # Base64 of JPEG data starts with "/9j/" (bytes FF D8 FF), so that prefix is never a path.
    return text.startswith("/") and not text.startswith("/9j/") and len(text) <= _PATH_MAX


def _local_path(text: str) -> str:
    if not text.lower().startswith("file:"):
        return text
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise MediaBlocked(f"file URL {shorten(text)!r} must be file:///absolute/path")
    return unquote(parts.path)


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    for root in roots:
        real_root = os.path.realpath(root)
        if os.path.commonpath([path, real_root]) == real_root:
            return True
    return False


def _read_local(text: str, policy: MediaPolicy) -> bytes:
    shown = shorten(text)
    setting = SETTING["allowed_local_roots"]
    if not policy.allowed_local_roots:
        raise MediaBlocked(
            f"local media paths are disabled ({shown!r}); send the media as a URL or base64, or "
            f"set {setting} to a directory to allow files under it"
        )
    path = _local_path(text)
    if "\x00" in path or not os.path.isabs(path):
        raise MediaBlocked(f"local media path {shown!r} must be an absolute path")
    real = os.path.realpath(path)  # follows symlinks, so a link cannot lead out of the roots
    if not _inside(real, policy.allowed_local_roots):
        raise MediaBlocked(f"local media path {shown!r} is outside the directories in {setting}")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:  # O_NONBLOCK: a FIFO planted under a root must not hang the worker thread
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise MediaError(f"local media file {shown!r} does not exist") from None
    except OSError:
        raise MediaError(f"local media file {shown!r} cannot be read") from None
    try:
        data = _read_fd(fd, shown, policy)
    finally:
        os.close(fd)
    if not data:
        raise MediaError(f"local media file {shown!r} is empty")
    return data


def _read_fd(fd: int, shown: str, policy: MediaPolicy) -> bytes:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise MediaError(f"local media path {shown!r} is not a regular file")
    if info.st_size > policy.max_bytes:
        raise _too_large("file", policy, info.st_size)
    with os.fdopen(os.dup(fd), "rb") as file:
        data = file.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:  # the file grew after fstat
        raise _too_large("file", policy)
    return data


# -- http(s) ---------------------------------------------------------------------------------


async def _fetch_http(
    url: str, policy: MediaPolicy, client: httpx.AsyncClient | None, resolver: Resolver
) -> bytes:
    timeout = policy.fetch_timeout
    try:
        if client is not None:
            return await asyncio.wait_for(_follow(url, policy, client, resolver), timeout)
        # No keep-alive: a pooled TLS connection (keyed by IP) must not carry another host name.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(
            trust_env=False, follow_redirects=False, timeout=timeout, limits=limits
        ) as c:
            return await asyncio.wait_for(_follow(url, policy, c, resolver), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise MediaError(
            f"fetching {shorten(url)!r} timed out after {timeout:g}s ({SETTING['fetch_timeout']})"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise MediaError(
            f"could not fetch {shorten(url)!r}: {type(exc).__name__}; check that the URL is "
            "reachable from the server"
        ) from None


async def _follow(
    url: str, policy: MediaPolicy, client: httpx.AsyncClient, resolver: Resolver
) -> bytes:
    target, what = parse_http_url(url), "media URL"
    allow = policy.allow_private_networks
    for _ in range(policy.max_redirects + 1):
        address = await vet_target(target, allow_private=allow, resolver=resolver, what=what)
        request = _pinned_request(client, target, address)
        response = await client.send(request, stream=True, follow_redirects=False)
        try:
            if response.has_redirect_location:
                location = urljoin(str(target.url), response.headers["location"])
                target, what = parse_http_url(location, what="redirect to"), "redirect to"
                continue
            if not response.is_success:
                raise MediaError(
                    f"fetching {shorten(url)!r} failed: the server answered HTTP "
                    f"{response.status_code}"
                )
            return await _read_body(response, policy, url)
        finally:
            await response.aclose()
    raise MediaError(
        f"fetching {shorten(url)!r} followed more than {policy.max_redirects} redirects "
        f"({SETTING['max_redirects']}); link the final URL directly"
    )


def _pinned_request(client: httpx.AsyncClient, target: Target, address: IPAddress) -> httpx.Request:
    """GET to the vetted address, with the original Host header and TLS name (SNI)."""
    url = target.url.copy_with(host=str(address))
    extensions = {}
    if target.url.scheme == "https" and target.literal is None:
        extensions["sni_hostname"] = target.host
    headers = {
        "Host": target.host_header,
        "Accept": "image/*, video/*, */*;q=0.5",
        "Accept-Encoding": "identity",
        "User-Agent": _USER_AGENT,
    }
    return client.build_request("GET", url, headers=headers, extensions=extensions)


async def _read_body(response: httpx.Response, policy: MediaPolicy, url: str) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_bytes:
        raise _too_large("download", policy, int(declared))
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > policy.max_bytes:
            raise _too_large("download", policy)
    if not body:
        raise MediaError(f"fetching {shorten(url)!r} returned an empty body")
    return bytes(body)
