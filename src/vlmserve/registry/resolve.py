"""One resolver for every list of models: the registry file (the CLI) and the server's.

A query is a name, an alias, a served id, or ``role:<role>``. A role picks the first current
(not deprecated) model that has it; roles other than ``chat``, ``embedding`` and ``rerank``
(``caption``, ``extract``, ...) fall back to the first current chat model. Deprecated models
still resolve by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from vlmserve.errors import NotFound
from vlmserve.registry.entries import ROLE_PREFIX

__all__ = ["ROLE_PREFIX", "Resolvable", "by_role", "resolve"]

_NO_FALLBACK = ("chat", "embedding", "rerank")


class Resolvable(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def roles(self) -> list[str]: ...
    @property
    def deprecated(self) -> bool: ...


T = TypeVar("T", bound=Resolvable)


def resolve(items: Sequence[T], query: str, lookup: Callable[[str], T | None], where: str) -> T:
    """``query`` by ``lookup`` (name, alias, served id) or role; ``NotFound`` lists what exists.
    ``where`` completes "model 'x' is not ..." (``in the registry``, ``on this server``)."""
    if query.startswith(ROLE_PREFIX):
        return by_role(items, query.removeprefix(ROLE_PREFIX))
    found = lookup(query)
    if found is None:
        raise NotFound(
            f"model {query!r} is not {where}; {available(items)}",
            param="model",
            code="model_not_found",
        )
    return found


def by_role(items: Sequence[T], role: str) -> T:
    holders = [item for item in items if role in item.roles]
    current = [item for item in holders if not item.deprecated]
    if not current and role not in _NO_FALLBACK:
        current = [i for i in items if "chat" in i.roles and not i.deprecated]
    if current:
        return current[0]
    if holders:
        names = ", ".join(item.name for item in holders)
        message = (
            f"role {role!r} is held only by deprecated models ({names}); request one "
            "by name or give the role to a current model"
        )
    else:
        message = (
            f'no model has role {role!r}; give one `roles = ["{role}"]` in the '
            f"registry or [[models]] config; {available(items)}"
        )
    raise NotFound(message, param="model", code="model_not_found")


def available(items: Sequence[Resolvable]) -> str:
    current = [i.name for i in items if not i.deprecated]
    old = [i.name for i in items if i.deprecated]
    text = f"available: {', '.join(current) or '(none)'}"
    if old:
        text += f" (deprecated: {', '.join(old)})"
    roles = sorted({role for item in items for role in item.roles})
    listed = ", ".join(f"{ROLE_PREFIX}{role}" for role in roles)
    return text + (f"; roles: {listed}" if listed else "")
