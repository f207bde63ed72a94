"""``json_response``: a large answer serialised in pieces is the same JSON as one call."""

from __future__ import annotations

import json
import threading

import vlmserve.api.json_response as json_response_module
from vlmserve.api.endpoints.chat.choices import Answer
from vlmserve.api.endpoints.chat.objects import CompletionIds
from vlmserve.api.json_response import dumps, json_response
from vlmserve.engine.types import Chunk, FinishReason


def _answer(tokens: int) -> dict:
    top = [{"token": f"t{k}", "logprob": -k / 3, "bytes": (116, 48 + k % 10)} for k in range(20)]
    item = {"token": 'a\u2028"', "logprob": -0.5, "bytes": [97], "top_logprobs": top}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "x" * 10},
        "logprobs": {"content": [item] * tokens},
        "finish_reason": "length",
    }
    return {
        "id": "c",
        "choices": [choice, {**choice, "index": 1}],
        "usage": {"n": 2**70},
        "empty": {},
        "none": None,
        "list": [],
    }


def test_pieces_are_the_same_json_as_one_serialisation() -> None:
    for tokens in (0, 1, 255, 256, 257, 1000):
        value = _answer(tokens)
        assert json.loads(dumps(value)) == json.loads(json.dumps(value))


async def test_a_large_answer_is_a_prepared_json_response() -> None:
    value = _answer(2000)
    response = await json_response(value)
    assert response.media_type == "application/json"
    assert json.loads(response.body) == json.loads(json.dumps(value))


async def test_a_gathered_logprobs_answer_is_serialised_off_the_event_loop(monkeypatch) -> None:
    # The chat path keeps each logprobs item as JSON bytes; the answer it builds must still
    # show json_response its long lists, or the whole answer is written on the loop at once.
    top = [{"token": f"t{k}", "logprob": -1.0, "bytes": [116]} for k in range(20)]
    answer = Answer()
    for step in range(600):
        for index in range(2):
            item = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": top}
            answer.add(Chunk("a", [step], None, 3, step + 1, logprobs=[item], index=index))
    for index in range(2):
        answer.add(Chunk("", [], FinishReason.LENGTH, 3, 600, index=index))
    body = answer.body(CompletionIds("chatcmpl-x", 0, "m"))
    threads: list[threading.Thread] = []
    real = json_response_module.dumps

    def recording(value: object) -> bytes:
        threads.append(threading.current_thread())
        return real(value)

    monkeypatch.setattr(json_response_module, "dumps", recording)
    response = await json_response(body)
    assert threads and threads[0] is not threading.main_thread()
    sent = json.loads(response.body)
    assert [c["index"] for c in sent["choices"]] == [0, 1]
    for choice in sent["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 600 and content[599]["top_logprobs"] == top
