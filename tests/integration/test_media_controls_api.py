"""Per-request media controls and media by reference, through the API (tiny Qwen2-VL).

``mm_processor_kwargs.max_pixels`` and ``detail: low`` lower ``usage.prompt_tokens`` by
exactly what the model's processor computes for those budgets; values above the server's caps
are 400s naming the cap's setting; a part sent once with a ``uuid`` is reused by a later
request that sends the ``uuid`` alone (not decoded again: the metrics' media bytes do not
move), an unknown ``uuid`` is a 400 that says to send the data again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from support import MODEL
from vlmserve.testing.media import data_url, image_bytes, mp4_bytes

URL = data_url(image_bytes(256, 192), "image/png")


def chat(parts: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "Describe."}]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 3,
        **extra,
    }


def image_part(url: str | None = URL, **extra: Any) -> dict[str, Any]:
    detail = extra.pop("ref", {})
    ref = None if url is None else {"url": url, **detail}
    return {"type": "image_url", "image_url": ref, **extra}


def processor_count(tiny_dir: Path, **kwargs: Any) -> int:
    """The prompt's length as the model's own processor computes it for the same image."""
    from transformers import AutoProcessor

    from vlmserve.media import MediaPolicy, decode_image
    from vlmserve.testing.media import image_bytes as raw

    processor = AutoProcessor.from_pretrained(tiny_dir)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image: Image.Image = decode_image(raw(256, 192), MediaPolicy())
    out = processor(text=[text], images=[image], return_tensors="pt", **kwargs)
    return int(out["input_ids"].shape[1])


async def prompt_tokens(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


async def test_max_pixels_and_detail_low_lower_prompt_tokens_as_the_processor_computes(
    client: httpx.AsyncClient, tiny_dir: Path
) -> None:
    default = await prompt_tokens(client, chat([image_part()]))
    assert default == processor_count(tiny_dir)
    small = await prompt_tokens(
        client, chat([image_part()], mm_processor_kwargs={"max_pixels": 4000})
    )
    size = {"shortest_edge": 3136, "longest_edge": 4000}  # the tiny processor's minimum kept
    assert small == processor_count(tiny_dir, images_kwargs={"size": size}) < default
    low = await prompt_tokens(client, chat([image_part(ref={"detail": "low"})]))
    budget = 50176 // 4  # a quarter of the tiny processor's 50176-pixel default budget
    size = {"shortest_edge": 3136, "longest_edge": budget}
    expected = processor_count(tiny_dir, images_kwargs={"size": size})
    assert low == expected < default
    high = await prompt_tokens(client, chat([image_part(ref={"detail": "high"})]))
    assert high == default


@pytest.mark.parametrize(
    ("extra", "param", "setting"),
    [
        (
            {"mm_processor_kwargs": {"max_pixels": 4096 * 4096 + 1}},
            "mm_processor_kwargs.max_pixels",
            "VLMSERVE_MAX_IMAGE_PIXELS",
        ),
        (
            {"media_io_kwargs": {"video": {"num_frames": 17}}},
            "media_io_kwargs.video.num_frames",
            "VLMSERVE_MAX_VIDEO_FRAMES",
        ),
        (
            {"mm_processor_kwargs": {"num_frames": 17}},
            "mm_processor_kwargs.num_frames",
            "VLMSERVE_MAX_VIDEO_FRAMES",
        ),
        ({"mm_processor_kwargs": {"do_resize": False}}, "mm_processor_kwargs.do_resize", None),
        ({"mm_processor_kwargs": {"fps": 2, "num_frames": 4}}, "mm_processor_kwargs.fps", None),
        ({"mm_processor_kwargs": {"max_pixels": -1}}, "mm_processor_kwargs.max_pixels", None),
    ],
)
async def test_controls_above_a_cap_or_not_served_are_400s(
    client: httpx.AsyncClient, extra: dict[str, Any], param: str, setting: str | None
) -> None:
    r = await client.post("/v1/chat/completions", json=chat([image_part()], **extra))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    if setting is not None:
        assert setting in error["message"]


async def test_detail_must_be_one_per_request(client: httpx.AsyncClient) -> None:
    parts = [image_part(ref={"detail": "low"}), image_part(ref={"detail": "high"})]
    r = await client.post("/v1/chat/completions", json=chat(parts))
    assert r.status_code == 400 and "detail" in r.json()["error"]["message"]


def _counter(text: str, name: str, label: str = "") -> float:
    pattern = rf"^vlmserve_{name}_total(\{{[^}}]*{label}[^}}]*\}})? ([0-9.e+]+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE))


async def test_a_uuid_alone_reuses_the_media_without_decoding_it(
    make_client: Any,
) -> None:
    client = await make_client()
    first = await client.post("/v1/chat/completions", json=chat([image_part(uuid="cat-1")]))
    assert first.status_code == 200, first.text
    before = (await client.get("/metrics")).text
    again = await client.post("/v1/chat/completions", json=chat([image_part(None, uuid="cat-1")]))
    assert again.status_code == 200, again.text
    after = (await client.get("/metrics")).text
    # The same tokens; only cached_tokens may differ (the second can reuse the first's prefix).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [again.json()["usage"][k] for k in counts] == [first.json()["usage"][k] for k in counts]
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert _counter(after, "media_bytes") == _counter(before, "media_bytes")  # no fetch/decode
    assert (
        _counter(after, "media_uuid", 'result="hit"')
        == _counter(before, "media_uuid", 'result="hit"') + 1
    )
    hits = _counter(after, "processor_cache_hits") - _counter(before, "processor_cache_hits")
    assert hits == 1  # the same pixels: the processed image is reused too


async def test_an_unknown_uuid_or_other_options_is_a_400_that_says_what_to_send(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/chat/completions", json=chat([image_part(None, uuid="never-sent")]))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[0]"
    assert "send the data again" in r.json()["error"]["message"]
    sent = await client.post("/v1/chat/completions", json=chat([image_part(uuid="dog-1")]))
    assert sent.status_code == 200, sent.text
    other = chat([image_part(None, uuid="dog-1", ref={})], mm_processor_kwargs={"max_pixels": 4000})
    r = await client.post("/v1/chat/completions", json=other)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "media_uuid_options", r.text


async def test_uuids_are_per_api_key(make_client: Any) -> None:
    client = await make_client(api_keys=["key-a", "key-b"])
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    sent = await client.post("/v1/chat/completions", json=chat([image_part(uuid="x")]), headers=a)
    assert sent.status_code == 200, sent.text
    body = chat([image_part(None, uuid="x")])
    assert (await client.post("/v1/chat/completions", json=body, headers=b)).status_code == 400
    assert (await client.post("/v1/chat/completions", json=body, headers=a)).status_code == 200


async def test_responses_take_a_uuid_alone_too(client: httpx.AsyncClient) -> None:
    def body(part: dict[str, Any]) -> dict[str, Any]:
        content = [part, {"type": "input_text", "text": "Describe."}]
        return {
            "model": MODEL,
            "input": [{"role": "user", "content": content}],
            "max_output_tokens": 3,
        }

    first = await client.post(
        "/v1/responses", json=body({"type": "input_image", "image_url": URL, "uuid": "r-1"})
    )
    assert first.status_code == 200, first.text
    again = await client.post("/v1/responses", json=body({"type": "input_image", "uuid": "r-1"}))
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["input_tokens"] == first.json()["usage"]["input_tokens"]


async def test_media_io_num_frames_sets_the_frames_of_a_video(client: httpx.AsyncClient) -> None:
    url = data_url(mp4_bytes(frames=24, fps=8), "video/mp4")
    part = {"type": "video_url", "video_url": {"url": url}}
    four = await prompt_tokens(client, chat([part], media_io_kwargs={"video": {"num_frames": 4}}))
    eight = await prompt_tokens(client, chat([part], mm_processor_kwargs={"num_frames": 8}))
    assert eight > four
