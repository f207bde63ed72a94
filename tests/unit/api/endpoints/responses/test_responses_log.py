"""ResponseLog: the events of a response, numbered like session events, and folded back."""

from __future__ import annotations

import json

from vlmserve.api.endpoints.responses.objects import ResponseLog, base_response
from vlmserve.api.endpoints.responses.protocol import ResponsesRequest
from vlmserve.api.endpoints.responses.sse import encode_response_event
from vlmserve.engine.types import Chunk, FinishReason
from vlmserve.streaming import DONE, Emit, Event, SessionState, error_emit


def request() -> dict:
    body = ResponsesRequest(model="m", input="hi", background=True)
    return {"response": base_response(body, "resp_1", "m"), "message_id": "msg_1"}


def numbered(emits: list[Emit], start: int = 0) -> list[Event]:
    return [Event(start + i, e.data, e.event, e.meta) for i, e in enumerate(emits)]


def test_sequence_numbers_are_the_session_indices() -> None:
    log = ResponseLog.restore(request(), [])
    emits = [*log.preamble(), *log.delta("a", [1]), *log.delta("b", [2])]
    emits += log.finish(Chunk("", [], FinishReason.STOP, 3, 2))
    data = [json.loads(e.data) for e in emits]
    assert [d["sequence_number"] for d in data] == list(range(len(emits)))
    assert [d["type"] for d in data] == [e.event for e in emits]
    assert data[-1]["type"] == "response.completed"
    assert data[-1]["response"]["usage"]["total_tokens"] == 5
    assert data[-1]["response"]["output"][0]["content"][0]["text"] == "ab"


def test_a_restored_log_goes_on_where_the_stored_events_end() -> None:
    first = ResponseLog.restore(request(), [])
    events = numbered([*first.preamble()[:2]])  # killed after response.in_progress
    log = ResponseLog.restore(request(), events)
    more = [*log.preamble(), *log.delta("x", [7])]
    assert [e.event for e in more] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert json.loads(more[0].data)["sequence_number"] == 2
    again = ResponseLog.restore(request(), [*events, *numbered(more, start=2)])
    assert again.text == "x" and again.next_seq == 5
    assert again.snapshot(SessionState.RUNNING)["status"] == "in_progress"


def test_snapshots_of_ended_sessions_without_a_final_event() -> None:
    log = ResponseLog.restore(request(), [])
    events = numbered([*log.preamble(), *log.delta("p", [1])])
    assert (
        ResponseLog.restore(request(), events).snapshot(SessionState.RUNNING)["output"][0][
            "content"
        ][0]["text"]
        == "p"
    )
    cancelled = ResponseLog.restore(request(), [*events, Event(5, DONE, terminal=True)])
    assert cancelled.snapshot(SessionState.CANCELLED)["status"] == "cancelled"
    restart = error_emit("cannot continue", "server_restart")
    failed = ResponseLog.restore(request(), [*events, Event(5, restart.data, "error")])
    snapshot = failed.snapshot(SessionState.FAILED)
    assert snapshot["status"] == "failed" and snapshot["error"]["code"] == "server_restart"


def test_cancel_and_error_end_with_a_terminal_response_event() -> None:
    log = ResponseLog.restore(request(), [])
    log.preamble()
    log.delta("so far", [1])
    cancel = log.on_cancel()
    assert [e.event for e in cancel][-1] == "response.cancelled"
    assert json.loads(cancel[-1].data)["response"]["status"] == "cancelled"
    failed = ResponseLog.restore(request(), []).on_error(RuntimeError("boom /secret/path"))
    error = json.loads(failed[-1].data)["response"]["error"]
    assert error["code"] == "server_error" and "secret" not in error["message"]


def test_a_session_error_event_becomes_an_openai_error_event() -> None:
    gap = error_emit("events are gone", "stream_gap")
    wire = encode_response_event(Event(4, gap.data, "error")).decode()
    kind, data = wire.removeprefix("event: ").strip().split("\ndata: ")
    assert kind == "error"
    assert json.loads(data) == {
        "type": "error",
        "sequence_number": 4,
        "code": "stream_gap",
        "message": "events are gone",
        "param": None,
    }
