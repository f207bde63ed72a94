"""Whose a session is: every name a client uses lives in the namespace of its API key.

A session, its aliases (a chat stream's ``chatcmpl-`` id) and a stored response are kept in
the store under ``<tenant>/<name>``, where the tenant is the caller's key digest
(``vlmserve.api.auth.owner_of``); without API keys the tenant is ``""`` and names are kept as
they are. So another key's lookup of the same name finds nothing (the same 404 as an unknown
id), two keys may both use ``session_id: "abc"``, and the owner survives restarts and every
store (it is part of the stored name). Client names never hold ``/`` (``validate_session_id``
is stricter for what a client chooses), so one key's names cannot reach another's.
"""

from __future__ import annotations

__all__ = ["scoped", "unscoped"]

_SEP = "/"


def scoped(tenant: str, name: str) -> str:
    """The stored name of ``name`` for ``tenant`` (itself when ``tenant`` is empty)."""
    return f"{tenant}{_SEP}{name}" if tenant else name


def unscoped(name: str) -> str:
    """The name a client knows (``scoped``'s inverse: the part after the tenant). Only scoped
    names hold a ``/``: a session's id, alias or response id never does."""
    tenant, sep, rest = name.partition(_SEP)
    return rest if sep and tenant else name
