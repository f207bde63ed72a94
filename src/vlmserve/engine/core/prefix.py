"""Prefix-cache keys: one hash per full block of a prompt, over everything up to its end.

Block ``i``'s key is ``sha256(key of block i-1 + its token ids [+ the media digest])``, so
two prompts share block ``i`` only when their first ``(i + 1) * block_size`` tokens are equal.
A cryptographic hash, not Python's ``hash``: a client who could build a colliding prompt
would read another request's cached K/V (vLLM's advisory GHSA-rm76-4mrf-v9r8 moved it to
SHA-256 for that reason).

Images and videos enter the prompt as runs of one placeholder token id whatever they show,
so from the block that holds the first placeholder on, the key also covers a digest of the
request's media (their content keys, in prompt order): text before the first image (a
system prompt, say) is shared across requests with different images; what follows an image
is shared only by requests with the same images, whose rotary positions are the same too.

A request's ``cache_salt`` (vLLM's field) starts the chain: salted requests share blocks only
with requests that carry the same salt, so a tenant cannot time the cache to learn whether
another tenant sent a prompt.
"""

from __future__ import annotations

import hashlib
from array import array

__all__ = ["block_hashes"]


def block_hashes(
    ids: list[int],
    block_size: int,
    media: tuple[int, bytes] | None = None,
    salt: str | None = None,
) -> list[bytes]:
    """Keys of the full blocks of ``ids``. ``media``: (index of the first placeholder token,
    digest of all media) or None for a text prompt; ``salt``: the request's cache salt."""
    keys: list[bytes] = []
    previous = b"" if salt is None else hashlib.sha256(b"cache_salt:" + salt.encode()).digest()
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hashlib.sha256(previous)
        h.update(array("q", ids[start : start + block_size]).tobytes())
        if media is not None and start + block_size > media[0]:
            h.update(media[1])
        previous = h.digest()
        keys.append(previous)
    return keys
