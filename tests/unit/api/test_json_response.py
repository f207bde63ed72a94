"""``json_response``: a large answer serialised in pieces is the same JSON as one call."""

from __future__ import annotations

import json

from vlmserve.api.json_response import dumps, json_response


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
