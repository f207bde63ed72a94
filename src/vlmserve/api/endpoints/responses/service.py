"""OpenAI's Responses API on ChatService's pipeline and the session store of chat streams.

A response is a ChatCompletionRequest run through the same steps as a chat stream (model
lease, admission, media limits and decoding, ``prepare``, metrics, the proxied path), whose
engine chunks become Responses events in a session named by the response id. The session
store (memory, SQLite, Redis) therefore keeps stored and background responses exactly as it
keeps chat streams: replay and resume by sequence number, cancel, and, with a persistent
store, continuation after a restart (``_resume``, through the SessionManager's resumer; chat
sessions go on to ``ChatService.resume``).

``store: false`` responses are not retrievable; a non-streamed one runs through
``ChatService.complete`` and never touches the store; a streamed one runs as a session of
``unstored``, a manager of its own on a memory store: its prompt, images and events never
reach the disk (nor Redis), and are gone with the process. ``DELETE`` leaves a tombstone session
(``<id>.deleted``, of kind ``deleted``): the store has no delete yet, and both expire with the
sessions' TTL.

A stored response belongs to the API key that made it: its session, and its tombstone, are in
that key's namespace (``streaming/scope.py``; ``api_owner`` in its record too: the auth
digest, never the key), so for any other key every call on it, ``previous_response_id``
included, is the same 404 as for an unknown id, and no other key's session name (a chat
``session_id`` such as ``<id>.deleted``) can touch it. It is kept ``sessions_ttl_seconds``
after its last event (the store's retention, enforced here too so that an expired one is a 404
before the store's sweep has run).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from vlmserve.api.auth import ANONYMOUS
from vlmserve.api.common.generation import seeded
from vlmserve.api.endpoints.chat.service import ChatService, tenant_of
from vlmserve.api.endpoints.files.service import FilesService
from vlmserve.api.endpoints.responses.convert import (
    assistant_message,
    check_supported,
    input_messages,
    remap,
    to_chat_request,
)
from vlmserve.api.endpoints.responses.files import MediaLimits, attach_files
from vlmserve.api.endpoints.responses.items import input_items, list_page
from vlmserve.api.endpoints.responses.objects import (
    ResponseLog,
    base_response,
    new_message_id,
    new_response_id,
    usage,
)
from vlmserve.api.endpoints.responses.protocol import ResponsesRequest
from vlmserve.api.endpoints.responses.stream import produce, resumption
from vlmserve.api.resume_token import issue, token_alias
from vlmserve.engine.types import INTERACTIVE_PRIORITY
from vlmserve.errors import InvalidRequest, NotFound, VlmserveError
from vlmserve.streaming import (
    FINAL_STATES,
    Emit,
    Event,
    MemoryStore,
    Resumer,
    Resumption,
    SessionManager,
    SessionRecord,
    SessionState,
)
from vlmserve.streaming.scope import scoped, unscoped

__all__ = ["KIND", "ResponsesService"]

log = logging.getLogger(__name__)

KIND = "response"  # SessionRecord.request["kind"] of a response's session
_FINISH_STATUS = {"stop": "completed", "length": "incomplete", "cancelled": "cancelled"}


def _tombstone(response_id: str) -> str:
    return f"{response_id}.deleted"


async def _no_events() -> AsyncIterator[Emit]:
    return
    yield  # an async generator that ends at once


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )


class ResponsesService:
    def __init__(
        self,
        chat: ChatService,
        chat_resumer: Resumer | None = None,
        files: FilesService | None = None,
    ) -> None:
        self.chat = chat
        self.sessions = chat.sessions
        self.unstored = SessionManager(
            MemoryStore(ttl=self.sessions.ttl),
            ring_size=self.sessions.options.ring_size,
            ttl=self.sessions.ttl,
        )
        self.files = files  # for input_image file_id; None: only URLs
        # One resumer per SessionManager: ours continues responses, the chat one the rest.
        self._chat_resumer = chat_resumer
        self.sessions.set_resumer(self._resume)

    # -- create ---------------------------------------------------------------------------

    async def _conversation(
        self, body: ResponsesRequest, owner: str
    ) -> tuple[list[dict[str, Any]], list[list[int | str]]]:
        """Earlier turns (``previous_response_id``: its input and its answer) + this input, and
        where in it images came from files (``[message, part, file_id]``)."""
        history: list[dict[str, Any]] = []
        files: list[list[int | str]] = []
        if body.previous_response_id:
            record, rlog = await self._load(
                body.previous_response_id, owner, "previous_response_id"
            )
            previous = rlog.snapshot(record.state)
            if previous["status"] in ("queued", "in_progress"):
                raise InvalidRequest(
                    f"response {body.previous_response_id!r} is still {previous['status']}; "
                    "wait for it to finish (GET /v1/responses/{id}) before continuing it",
                    param="previous_response_id",
                )
            turns = record.request["body"]["messages"][record.request["turns_from"] :]
            history = [*turns, assistant_message(output_text(previous))]
            files = list(record.request.get("input_files", []))
        settings = self.chat.converter.settings
        limits = MediaLimits(settings.max_media_per_request, settings.max_media_bytes)
        attached = await attach_files(body, owner, self.files, limits)
        files += [[len(history) + int(i), j, f] for i, j, f in attached]
        return [*history, *input_messages(body)], files

    async def start(
        self, body: ResponsesRequest, request_id: str, owner: str = ANONYMOUS
    ) -> tuple[str, str]:
        """Validate, prepare (every 4xx before a byte is sent), then run it as a session in
        ``owner``'s namespace; its id and resume token (``resume_token.py``)."""
        check_supported(body, strict=getattr(self.chat.converter.settings, "strict_fields", False))
        conversation, files = await self._conversation(body, owner)
        chat_body = seeded(to_chat_request(body, conversation), self.sessions.durable)
        try:
            generation = await self.chat.open_generation(chat_body, request_id, owner=owner)
        except VlmserveError as exc:
            raise remap(exc) from None
        response_id = new_response_id()
        request = {
            "kind": KIND,
            "store": body.store,
            "background": body.background,
            "api_owner": owner,
            "message_id": new_message_id(),
            "turns_from": len(chat_body.messages) - len(conversation),
            "input_files": files,
            "body": chat_body.model_dump(mode="json"),
            "response": base_response(body, response_id, generation.model_id),
        }
        rlog = ResponseLog.restore(request, [])
        token, token_alias = issue()
        try:
            session = await self.manager(body.store).start(
                response_id,
                request,
                produce(rlog, generation, self.chat.timed(chat_body)),
                on_cancel=rlog.on_cancel,
                on_error=rlog.on_error,
                tenant=tenant_of(owner),
                secret_aliases=[token_alias],
            )
        except BaseException:
            await generation.abandon()
            raise
        if body.background or not body.stream:
            # Nobody listens, yet nothing may cancel it for that: a background response runs
            # without a client; a plain request waits for it (and cancels it if it leaves).
            session.attach()
        return response_id, token

    def manager(self, store: bool) -> SessionManager:
        """Where a response's session runs: the sessions' store, or memory (``store: false``)."""
        return self.sessions if store else self.unstored

    async def close(self) -> None:
        await self.unstored.close()

    async def finished(self, response_id: str, owner: str = ANONYMOUS) -> dict[str, Any]:
        """The response once its generation has ended (a stored, non-streamed create)."""
        session = self.sessions.get(response_id, tenant_of(owner))
        if session is not None:
            await session.wait()
        return await self.retrieve(response_id, owner)

    async def complete_unstored(
        self,
        body: ResponsesRequest,
        request_id: str,
        owner: str = ANONYMOUS,
        *,
        priority: int = INTERACTIVE_PRIORITY,
    ) -> dict[str, Any]:
        """``store: false``, not streamed: ChatService's JSON answer, as a Response."""
        check_supported(body, strict=getattr(self.chat.converter.settings, "strict_fields", False))
        conversation, _ = await self._conversation(body, owner)
        chat_body = seeded(to_chat_request(body, conversation), self.sessions.durable)
        try:
            answer = await self.chat.complete(chat_body, request_id, priority=priority, owner=owner)
        except VlmserveError as exc:
            raise remap(exc) from None
        rlog = ResponseLog(
            base_response(body, new_response_id(), answer["model"]), new_message_id()
        )
        choice = answer["choices"][0]
        rlog.answered(choice["message"]["content"] or "", choice["message"].get("reasoning"))
        counts = answer["usage"]
        status = _FINISH_STATUS.get(choice["finish_reason"], "failed")
        rlog.metrics = answer.get("metrics")
        return rlog.response(status, usage(counts["prompt_tokens"], counts["completion_tokens"]))

    # -- stored responses -----------------------------------------------------------------

    def _expired(self, record: SessionRecord) -> bool:
        ttl = self.sessions.ttl
        return bool(ttl) and record.state in FINAL_STATES and record.updated_at < time.time() - ttl

    async def _record(
        self, response_id: str, owner: str, param: str | None = None
    ) -> SessionRecord:
        store, tenant = self.sessions.store, tenant_of(owner)
        record = None
        if response_id.startswith("resp_") and len(response_id) <= 64:
            record = await store.get(scoped(tenant, response_id))
        if (
            record is None
            or record.request.get("kind") != KIND
            or not record.request.get("store")
            or record.request.get("api_owner", ANONYMOUS) != owner
            or self._expired(record)
            or await self._deleted(scoped(tenant, _tombstone(response_id)))
        ):
            raise NotFound(
                f"no stored response {response_id!r} (unknown, deleted, created with "
                f"store: false, another API key's, or expired: responses are kept "
                f"{self.sessions.ttl:g}s after they end, VLMSERVE_SESSIONS_TTL_SECONDS)",
                param=param,
                code="response_not_found",
            )
        return record

    async def by_token(self, response_id: str, token: str | None) -> SessionRecord:
        """The stored response ``token`` was issued for, if it is ``response_id`` (else the
        404 of an unknown id); an orphaned one (a restart) continues here."""
        record = None if not token else await self.sessions.record(token_alias(token))
        if (
            record is None
            or record.request.get("kind") != KIND
            or not record.request.get("store")
            or unscoped(record.session_id) != response_id
            or self._expired(record)
            or await self._deleted(_tombstone(record.session_id))
        ):
            raise NotFound(f"no stored response {response_id!r}", code="response_not_found")
        if record.state is SessionState.RUNNING and self.sessions.get(record.session_id) is None:
            await self._take_over(record)
        return record

    async def _deleted(self, tombstone: str) -> bool:
        record = await self.sessions.store.get(tombstone)
        return record is not None and record.request.get("kind") == "deleted"

    async def _events(self, record: SessionRecord) -> list[Event]:
        events = await self.sessions.store.events(record.session_id, -1)
        session = self.sessions.get(record.session_id)
        if not events and session is not None:  # the memory store keeps no events
            events = list(session.ring)
        return events

    async def _current(
        self, response_id: str, owner: str, param: str | None = None
    ) -> SessionRecord:
        """The stored record, after continuing the response here if it was orphaned."""
        record = await self._record(response_id, owner, param)
        if record.state is SessionState.RUNNING and self.sessions.get(record.session_id) is None:
            await self._take_over(record)
            record = await self._record(response_id, owner, param)
        return record

    async def _load(
        self, response_id: str, owner: str, param: str | None = None
    ) -> tuple[SessionRecord, ResponseLog]:
        record = await self._current(response_id, owner, param)
        return record, ResponseLog.restore(record.request, await self._events(record))

    async def _take_over(self, record: SessionRecord) -> None:
        """A running response no process produces (a restart): continue it here, as opening
        a listener does for a chat stream (a live producer elsewhere is left alone)."""
        listener = self.sessions.listen(record.session_id, record.last_index)
        try:
            await listener
        except VlmserveError as exc:
            log.info("response %s: not taken over: %s", record.session_id, exc)
        finally:
            await listener.aclose()
        session = self.sessions.get(record.session_id)
        if session is not None and record.request.get("background"):
            session.attach()  # runs without a client, as before the restart

    async def retrieve(self, response_id: str, owner: str = ANONYMOUS) -> dict[str, Any]:
        record, rlog = await self._load(response_id, owner)
        return rlog.snapshot(record.state)

    async def check_stored(self, response_id: str, owner: str = ANONYMOUS) -> None:
        """404 unless stored (and the caller's); an orphaned one (a restart) continues here."""
        await self._current(response_id, owner)

    async def input_items(
        self,
        response_id: str,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: str = "desc",
    ) -> dict[str, Any]:
        """The conversation the response answered (earlier turns included), OpenAI's page."""
        record = await self._record(response_id, owner)
        return list_page(input_items(response_id, record.request), after, limit, order)

    async def cancel(self, response_id: str, owner: str = ANONYMOUS) -> dict[str, Any]:
        """Stop a running response (within an engine step); a finished one is returned as is."""
        await self._record(response_id, owner)
        await self.sessions.cancel(response_id, tenant_of(owner))
        return await self.retrieve(response_id, owner)

    async def delete(self, response_id: str, owner: str = ANONYMOUS) -> dict[str, Any]:
        await self._record(response_id, owner)
        await self.sessions.cancel(response_id, tenant_of(owner))
        with contextlib.suppress(InvalidRequest):  # InvalidRequest: deleted meanwhile
            await self.sessions.start(
                _tombstone(response_id),
                {"kind": "deleted"},
                _no_events(),
                on_cancel=list,
                on_error=lambda exc: [],
                tenant=tenant_of(owner),
            )
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # -- restart --------------------------------------------------------------------------

    async def _resume(self, record: SessionRecord, events: list[Event]) -> Resumption | None:
        if record.request.get("kind") != KIND:
            if self._chat_resumer is None:
                return None
            return await self._chat_resumer(record, events)
        try:
            return await resumption(self.chat, record.request, events, record.session_id)
        except (KeyError, VlmserveError, ValueError) as exc:
            log.warning("cannot continue response %s: %s", record.session_id, exc)
            return None
