"""Task endpoints through the app with the tiny model: NER, triples, KTP OCR, their limits.

The tiny model has random weights, so answers are gibberish; constrained decoding
(``response_format`` json_schema) still makes them parse and fit the schema, which is what
these tests pin: every key of each task's shape comes back, or a clear 4xx says why not.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from PIL import Image, ImageDraw

from support import MODEL
from vlmserve.tasks.id_card import ADDRESS_FIELDS, FIELDS
from vlmserve.testing.media import data_url, image_bytes

CARD_LINES = [
    "PROVINSI DKI JAKARTA",
    "JAKARTA PUSAT",
    "NIK : 3171232308900001",
    "Nama : BUDI SANTOSO",
    "Tempat/Tgl Lahir : JAKARTA, 23-08-1990",
    "Jenis Kelamin : LAKI-LAKI",
    "Alamat : JL. MERDEKA NO. 10",
    "RT/RW : 001/002",
    "Kel/Desa : GAMBIR",
    "Kecamatan : GAMBIR",
    "Agama : ISLAM",
    "Status Perkawinan : BELUM KAWIN",
    "Pekerjaan : KARYAWAN SWASTA",
    "Kewarganegaraan : WNI",
    "Berlaku Hingga : SEUMUR HIDUP",
]


def ktp_jpeg() -> bytes:
    """A KTP-like card: light blue, black text lines, a photo box."""
    card = Image.new("RGB", (480, 300), (170, 205, 235))
    draw = ImageDraw.Draw(card)
    for i, line in enumerate(CARD_LINES):
        draw.text((12, 8 + i * 19), line, fill=(0, 0, 0))
    draw.rectangle((360, 70, 460, 200), fill=(120, 120, 130))
    buf = io.BytesIO()
    card.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_envelope(body: dict[str, Any]) -> None:
    assert body["model"] == MODEL
    assert body["usage"]["completion_tokens"] >= 1


def assert_ktp_shape(body: dict[str, Any]) -> None:
    assert set(FIELDS) <= set(body)
    assert set(body["alamat"]) == set(ADDRESS_FIELDS)
    expected = {k for k in FIELDS if k != "alamat"} | {f"alamat.{k}" for k in ADDRESS_FIELDS}
    assert set(body["validation"]) == expected
    for check in body["validation"].values():
        assert isinstance(check["valid"], bool)
        assert check["valid"] or check["reason"]  # never flagged without saying why
    assert body["valid"] == all(c["valid"] for c in body["validation"].values())


async def test_entities_from_text_have_text_and_a_requested_type(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/extract/entities",
        json={
            "text": "Marie Curie was born in Warsaw in 1867.",
            "entity_types": ["PERSON", "PLACE"],
            "max_items": 2,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"entities", "model", "usage"}
    assert len(body["entities"]) <= 2
    for entity in body["entities"]:
        assert set(entity) == {"text", "type"}
        assert entity["type"] in ("PERSON", "PLACE")
    assert_envelope(body)


async def test_triples_from_an_image_have_subject_predicate_object(
    client: httpx.AsyncClient,
) -> None:
    image = data_url(image_bytes(64, 64), "image/png")
    response = await client.post("/v1/extract/triples", json={"images": [image], "max_items": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"triples", "model", "usage"}
    for triple in body["triples"]:
        assert set(triple) == {"subject", "predicate", "object"}
    assert_envelope(body)


async def test_a_clip_given_as_frames_is_read_as_one_video(client: httpx.AsyncClient) -> None:
    frames = [base64.b64encode(image_bytes(48, 48, "JPEG", seed=i)).decode() for i in range(3)]
    response = await client.post(
        "/v1/extract/entities", json={"frames": frames, "text": "A clip.", "max_items": 1}
    )
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"entities", "model", "usage"}


async def test_a_caller_schema_replaces_the_builtin_one(client: httpx.AsyncClient) -> None:
    schema = {
        "type": "object",
        "properties": {"summary": {"type": "string", "maxLength": 12}},
        "required": ["summary"],
        "additionalProperties": False,
    }
    response = await client.post(
        "/v1/extract/triples", json={"text": "Ann met Bob in Oslo.", "schema": schema}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"result", "model", "usage"}
    assert set(body["result"]) == {"summary"} and len(body["result"]["summary"]) <= 12


async def test_ktp_ocr_upload_returns_every_seed_field_with_validation(
    client: httpx.AsyncClient,
) -> None:
    files = {"file": ("ktp.jpg", ktp_jpeg(), "image/jpeg")}
    response = await client.post("/ktp-ocr/", files=files)
    assert response.status_code == 200, response.text
    body = response.json()
    assert_ktp_shape(body)
    assert_envelope(body)


async def test_id_card_json_endpoint_takes_a_data_url_and_a_caller_schema(
    client: httpx.AsyncClient,
) -> None:
    schema = {
        "type": "object",
        "properties": {"nik": {"type": "string", "maxLength": 16}},
        "required": ["nik"],
        "additionalProperties": False,
    }
    image = data_url(ktp_jpeg(), "image/jpeg")
    response = await client.post("/v1/extract/id-card", json={"image": image, "schema": schema})
    assert response.status_code == 200, response.text
    assert set(response.json()["result"]) == {"nik"}


async def test_validate_flags_a_nik_that_is_not_16_digits(client: httpx.AsyncClient) -> None:
    fields = {
        "nik": "31712323089000",
        "nama": "BUDI",
        "tgl_lahir": "23-08-1990",
        "jenis_kelamin": "L",
        "berlaku_hingga": "seumur hidup",
    }
    response = await client.post("/v1/extract/id-card/validate", json={"fields": fields})
    assert response.status_code == 200, response.text
    body = response.json()
    assert_ktp_shape(body)
    assert body["validation"]["nik"]["valid"] is False
    assert "16 digits" in body["validation"]["nik"]["reason"]
    assert body["nik"] == "31712323089000"  # kept as read, not silently "fixed"
    assert body["tgl_lahir"] == "1990-08-23" and body["berlaku_hingga"] == "SEUMUR HIDUP"
    assert body["validation"]["agama"] == {
        "valid": False,
        "reason": "not read from the card (null)",
    }
    assert body["valid"] is False


async def test_an_answer_cut_off_by_max_tokens_is_a_422_that_says_so(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(
        "/v1/extract/entities", json={"text": "Ann lives in Oslo.", "max_tokens": 1}
    )
    error = assert_error(response, 422)
    assert error["code"] == "invalid_model_output"
    assert "max_tokens" in error["message"]


async def test_an_upload_that_is_not_an_image_is_a_400_naming_the_file(
    client: httpx.AsyncClient,
) -> None:
    files = {"file": ("ktp.jpg", b"%PDF-1.4 definitely not an image" * 10, "image/jpeg")}
    assert_error(await client.post("/ktp-ocr/", files=files), 400, "file")


async def test_an_empty_or_missing_upload_is_refused(client: httpx.AsyncClient) -> None:
    empty = {"file": ("ktp.jpg", b"", "image/jpeg")}
    assert_error(await client.post("/ktp-ocr/", files=empty), 400, "file")
    assert_error(await client.post("/ktp-ocr/", data={"other": "x"}), 400, "file")
    assert_error(await client.post("/ktp-ocr/", json={"file": "x"}), 400, "file")


async def test_an_upload_over_the_media_byte_limit_is_a_413(make_client: Callable) -> None:
    client = await make_client(max_media_bytes=4096)
    files = {"file": ("ktp.jpg", ktp_jpeg() + b"\0" * 8192, "image/jpeg")}
    error = assert_error(await client.post("/ktp-ocr/", files=files), 413, "file")
    assert "VLMSERVE_MAX_MEDIA_BYTES" in error["message"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({}, 400, "text"),
        ({"text": "   "}, 400, "text"),
        ({"video": "data:video/mp4;base64,AAAA", "frames": ["AAAA"]}, 400, "frames"),
        ({"frames": []}, 400, "frames"),
        ({"images": ["bm90IGFuIGltYWdl"]}, 400, "images[0]"),
        ({"text": "x", "schema": {"type": "array"}}, 400, "schema"),
        ({"text": "x", "entity_types": ["A", "A"]}, 400, "entity_types"),
        ({"text": "x", "model": "nope"}, 404, "model"),
        ({"text": "x", "surprise": 1}, 400, "surprise"),
    ],
)
async def test_bad_extract_requests_are_clear_4xx(
    client: httpx.AsyncClient, body: dict, status: int, param: str
) -> None:
    assert_error(await client.post("/v1/extract/entities", json=body), status, param)
