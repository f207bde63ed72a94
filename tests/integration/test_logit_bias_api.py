"""``logit_bias`` through /v1/chat/completions: honoured (JSON and stream, the openai client's
own field), and malformed maps are 400s naming ``logit_bias``."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from support import MODEL

FORCED = 100  # an ordinary byte-level token id of the tiny tokenizer


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
        "max_tokens": 6,
        "ignore_eos": True,
        **extra,
    }


async def test_plus_100_makes_every_token_the_biased_one(client: httpx.AsyncClient) -> None:
    oai = openai.AsyncOpenAI(base_url="http://vlmserve.test/v1", api_key="x", http_client=client)
    kw = {**chat(), "extra_body": {"ignore_eos": True}}
    kw.pop("ignore_eos")
    plain = await oai.chat.completions.create(**kw, logprobs=True)
    forced = await oai.chat.completions.create(**kw, logprobs=True, logit_bias={str(FORCED): 100})
    tokens = [t.token for t in forced.choices[0].logprobs.content]
    assert len(tokens) == 6 and len(set(tokens)) == 1
    assert tokens != [t.token for t in plain.choices[0].logprobs.content]
    stream = await oai.chat.completions.create(**kw, stream=True, logit_bias={str(FORCED): 100})
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == forced.choices[0].message.content


@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ({"hello": 1}, "token ids"),
        ({"-3": 1}, "token ids"),
        ({"1.5": 1}, "token ids"),
        ({"9" * 5000: 1}, "token ids"),  # not a 500 from int() of 5000 digits
        ({"100": 101}, "-100..100"),
        ({"100": -100.5}, "-100..100"),
        ({"100": "high"}, "number"),
        ({"10000000": 5}, "vocabulary"),
    ],
)
async def test_a_malformed_logit_bias_is_a_400_naming_it(
    client: httpx.AsyncClient, bias: dict[str, Any], says: str
) -> None:
    r = await client.post("/v1/chat/completions", json=chat(logit_bias=bias))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("logit_bias") and says in error["message"]
