"""``Backend``: the one interface between the API (and the registry) and any model.

Every model kind implements it: ``hf`` chat and embedding models in this process, ``openai``
upstream replicas, ``vllm`` subprocesses. ``api/`` and ``registry/manager.py`` call only this
(no ``isinstance`` on a backend class outside ``engine/``); ``registry/build.py`` is the one
place that names the concrete classes.

A *proxied* backend (``proxied = True``, the gateway's ``openai`` and ``vllm`` models)
implements ``Proxied``, which extends ``Backend`` with what only a proxied model has: it
forwards the client's wire request (the API neither fetches nor decodes its media;
``GenerateRequest.raw`` carries the body), ``relay`` sends the worker and task endpoints
upstream as they are, streamed chat may pass to its replicas as bytes, and workers may join it
as replicas. Callers narrow with ``as_proxied(backend)`` (the flag, not a class check); a local
backend carries none of these members, and the API does its work here, through
``prepare``/``generate`` or ``embed``.

Concrete backends subclass ``Backend`` (or ``Proxied``) explicitly and inherit the defaults
below (no admission bound, no embeddings); torch-free, like ``engine/types.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from vlmserve.engine.types import (
    BackendStats,
    Chunk,
    EmbedInput,
    GenerateRequest,
    ModelState,
    Scored,
    ScorePair,
    Serves,
    Tokenized,
)
from vlmserve.errors import InvalidRequest, ServiceUnavailable

if TYPE_CHECKING:
    import numpy as np

    from vlmserve.media.sampling import VideoSampling

__all__ = ["Backend", "PassedAnswer", "Proxied", "as_proxied"]


class PassedAnswer(Protocol):
    """An upstream's answer to a passed request: status and headers in, body as it comes.
    ``chunks`` raises ``ServiceUnavailable`` when the upstream breaks off."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def replica_url(self) -> str: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def close(self, completed: bool) -> None: ...


def _nothing() -> None:
    pass


class Backend(Protocol):
    """One served model (see the module docstring)."""

    kind: ClassVar[str] = "hf"  # the registry's backend name: hf | openai | vllm
    proxied: ClassVar[bool] = False  # forwards wire requests; media are not decoded here
    model_id: str
    serves: Serves
    state: ModelState
    error: str | None
    load_seconds: float | None

    @property
    def also_serves(self) -> frozenset[Serves]:
        """Kinds of request answered besides ``serves``: a chat model with the ``rerank``
        role scores documents too (on the same weights and vision cache)."""
        return frozenset()

    # --- lifecycle ---------------------------------------------------------------------
    async def aload(self) -> None:
        """Load (off the event loop where it blocks); failures stay in ``state``/``error``."""
        ...

    async def aclose(self) -> None:
        """Unload from the event loop (clients closed, subprocesses stopped, memory freed)."""
        ...

    def close(self) -> None:
        """Synchronous best-effort unload (process shutdown)."""
        ...

    @property
    def memory_bytes(self) -> int:
        return 0

    def check_ready(self) -> None:
        """Raise the 503 that says why the model cannot serve now (unless it is READY)."""
        if self.state is not ModelState.READY:
            msg = f"model {self.model_id!r} is {self.state.value}"
            if self.error:
                msg += f": {self.error}"
            raise ServiceUnavailable(msg + "; retry shortly", retry_after=5)

    # --- generation ----------------------------------------------------------------------
    def admit(self) -> Callable[[], None]:
        """Reserve a queue place (``Overloaded``, a 429, when full); returns its release."""
        return _nothing

    async def prepare(self, request: GenerateRequest) -> Any:
        """Everything that can fail because of the input (template, processor, context
        length), so the API answers 4xx before a stream starts."""
        raise InvalidRequest(_no_chat(self), param="model", code="wrong_model_kind")

    def generate(self, prepared: Any) -> AsyncIterator[Chunk]:
        """The chunks of one prepared request; closing the iterator early cancels it."""
        raise InvalidRequest(_no_chat(self), param="model", code="wrong_model_kind")

    async def discard(self, prepared: Any) -> None:
        """Give back what ``prepare`` holds when ``generate`` will not run."""

    async def tokenize(
        self, what: GenerateRequest | str, *, add_special_tokens: bool = True
    ) -> Tokenized:
        """The prompt of a chat request as ``prepare`` builds it (template, media placeholders
        expanded: as many ids as its ``usage.prompt_tokens``), or a plain text's ids."""
        raise InvalidRequest(_no_chat(self), param="model", code="wrong_model_kind")

    async def detokenize(self, ids: list[int]) -> str:
        """The text of token ids of this model's tokenizer (special tokens included)."""
        raise InvalidRequest(_no_chat(self), param="model", code="wrong_model_kind")

    # --- embeddings ----------------------------------------------------------------------
    async def embed(self, items: list[EmbedInput]) -> np.ndarray:
        """``[len(items), dim]`` float32 unit vectors."""
        raise InvalidRequest(
            f"model {self.model_id!r} is not an embedding model; give an embedding model "
            '(roles = ["embedding"])',
            param="model",
            code="wrong_model_kind",
        )

    def count_tokens(self, items: list[EmbedInput]) -> int:
        """The prompt tokens ``embed`` reads for ``items`` (usage)."""
        return 0

    async def decode_tokens(self, arrays: list[list[int]]) -> list[str]:
        """Token-id inputs (``/v1/embeddings``) as the text they stand for."""
        raise InvalidRequest(
            f"model {self.model_id!r} does not take token ids; send text", param="input"
        )

    # --- scores ------------------------------------------------------------------------
    async def score(self, pairs: list[ScorePair]) -> Scored:
        """The relevance of each query-document pair (``/v1/rerank``, ``/v1/score``): a
        reranker's own score, or an embedding model's cosine similarity."""
        raise InvalidRequest(
            f"model {self.model_id!r} does not score documents; give a reranker "
            '(roles = ["rerank"]) or an embedding model (roles = ["embedding"])',
            param="model",
            code="wrong_model_kind",
        )

    def watch_failures(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(loop)`` (from any thread) when the model fails for good while
        loaded (a dead engine), so the manager can reload it; most backends never do."""

    def check_progress(self, timeout: float) -> bool:
        """Liveness, checked periodically: a model whose engine has had work but made no
        progress for ``timeout`` seconds is failed now (its requests end with a 503, the
        failure callback reloads it); True when that happened. Backends without an engine
        never are."""
        return False

    def capabilities(self) -> frozenset[str] | None:
        """Input kinds the loaded model takes ("vision", "video"); None: unknown (not loaded,
        or decided upstream)."""
        return None

    def video_sampling(self) -> VideoSampling | None:
        """The loaded model's frame rule (its family's, ``media.sampling``): which frames of a
        clip the API decodes for it; None: uniform (not loaded, or decided upstream)."""
        return None

    # --- observation ---------------------------------------------------------------------
    def stats(self) -> BackendStats:
        return BackendStats()

    def describe(self) -> dict[str, Any]:
        """Backend-specific state for ``/admin/state`` (upstream replicas, say)."""
        return {}


def _no_chat(backend: Backend) -> str:
    return (
        f"model {backend.model_id!r} is an embedding model; use /v1/embeddings or "
        "/encode-text and /encode-video with it"
    )


class Proxied(Backend, Protocol):
    """A model served upstream (see the module docstring); the gateway's backends."""

    proxied: ClassVar[bool] = True

    async def relay(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Answer the worker or task endpoint ``path`` upstream with ``body``."""
        ...

    def passes_streams(self) -> bool:
        """Streamed chat may pass to this model's upstream as bytes (``gateway/passthrough.py``):
        its replicas are vlmserve workers that run the streams as resumable sessions."""
        ...

    @property
    def upstream_name(self) -> str:
        """What the upstream calls this model."""
        ...

    async def pass_stream(
        self, path: str, content: bytes, headers: Mapping[str, str]
    ) -> PassedAnswer:
        """POST ``content`` to a replica (admitted and retried as any request of the model)."""
        ...

    async def pass_later(
        self,
        replica_url: str,
        method: str,
        path: str,
        content: bytes | None,
        headers: Mapping[str, str],
    ) -> PassedAnswer:
        """A passed stream's later request (resume, cancel), to the replica holding it."""
        ...

    @property
    def accepts_replicas(self) -> bool:
        """Workers may register as replicas of this model (``openai`` entries only)."""
        ...

    async def add_replica(self, url: str, instance: str) -> dict[str, Any]:
        """Add (or refresh) the replica ``url`` of ``instance``; its state."""
        ...

    def remove_replica(self, instance: str) -> bool:
        """Remove the instance's replica; whether it had one."""
        ...


def as_proxied(backend: Backend) -> Proxied | None:
    """``backend`` as a proxied model, or None for a local one (its ``proxied`` flag)."""
    return cast("Proxied", backend) if backend.proxied else None
