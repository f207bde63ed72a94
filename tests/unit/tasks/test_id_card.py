"""KTP post-validation: each field is normalised or flagged with a reason, never passed on."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from vlmserve.tasks import id_card_prompt, id_card_schema, schema_errors, validate_id_card
from vlmserve.tasks.id_card import ADDRESS_FIELDS, FIELDS

CARD: dict[str, Any] = {
    "nik": "3171 2323 0890 0001",  # region 317123, born 230890 (men: DD as is), 0001
    "nama": "BUDI  SANTOSO",
    "tempat_lahir": "JAKARTA",
    "tgl_lahir": "23-08-1990",
    "jenis_kelamin": "Laki-Laki",
    "alamat": {
        "jalan": "JL. MERDEKA NO. 10",
        "rt_rw": "1/ 2",
        "kelurahan_desa": "GAMBIR",
        "kecamatan": "GAMBIR",
        "kabupaten_kota": "JAKARTA PUSAT",
        "provinsi": "DKI JAKARTA",
    },
    "agama": "katholik",
    "status_perkawinan": "BELUM KAWIN",
    "pekerjaan": "KARYAWAN SWASTA",
    "kewarganegaraan": "WNI",
    "berlaku_hingga": "seumur  hidup",
}


def card(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(CARD)
    out.update(changes)
    return out


def test_a_good_card_is_valid_and_normalised() -> None:
    result = validate_id_card(CARD)
    assert result.valid, result.validation()
    f = result.fields
    assert f["nik"] == "3171232308900001"
    assert f["nama"] == "BUDI SANTOSO"
    assert f["tgl_lahir"] == "1990-08-23"
    assert f["jenis_kelamin"] == "LAKI-LAKI"
    assert f["agama"] == "KATOLIK"
    assert f["berlaku_hingga"] == "SEUMUR HIDUP"
    assert f["alamat"]["rt_rw"] == "001/002"
    checks = result.validation()
    assert set(checks) == {k for k in FIELDS if k != "alamat"} | {
        f"alamat.{k}" for k in ADDRESS_FIELDS
    }
    assert all(c == {"valid": True, "reason": None} for c in checks.values())


@pytest.mark.parametrize("nik", ["317123450890000", "31712345089000011", "3171234508900O01"])
def test_a_nik_that_is_not_16_digits_is_flagged_and_kept_as_read(nik: str) -> None:
    result = validate_id_card(card(nik=nik))
    check = result.checks["nik"]
    assert not check.valid and "16 digits" in (check.reason or "")
    assert result.fields["nik"] == nik
    assert not result.valid


def test_a_nik_whose_birth_date_disagrees_with_tgl_lahir_is_flagged() -> None:
    result = validate_id_card(card(tgl_lahir="24-08-1990"))
    assert result.checks["tgl_lahir"].valid
    assert not result.checks["nik"].valid
    assert "tgl_lahir" in (result.checks["nik"].reason or "")


def test_a_womans_nik_carries_day_plus_40() -> None:
    woman = card(nik="3171236308900001", jenis_kelamin="PEREMPUAN")
    assert validate_id_card(woman).checks["nik"].valid
    assert not validate_id_card(card(nik="3171236308900001")).checks["nik"].valid


@pytest.mark.parametrize(
    ("value", "expected"),
    [("23/08/1990", "1990-08-23"), ("23.08.1990", "1990-08-23"), ("1990-08-23", "1990-08-23")],
)
def test_dates_in_common_spellings_become_iso(value: str, expected: str) -> None:
    assert validate_id_card(card(tgl_lahir=value)).fields["tgl_lahir"] == expected


@pytest.mark.parametrize("value", ["31-02-1990", "1990", "23-08-2990", "kemarin"])
def test_impossible_or_future_birth_dates_are_flagged(value: str) -> None:
    check = validate_id_card(card(tgl_lahir=value)).checks["tgl_lahir"]
    assert not check.valid and check.reason


def test_berlaku_hingga_is_a_date_or_seumur_hidup() -> None:
    assert validate_id_card(card(berlaku_hingga="01-02-2030")).fields["berlaku_hingga"] == (
        "2030-02-01"
    )
    check = validate_id_card(card(berlaku_hingga="SELAMANYA")).checks["berlaku_hingga"]
    assert not check.valid and "SEUMUR HIDUP" in (check.reason or "")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("jenis_kelamin", "X"),
        ("agama", "JEDI"),
        ("status_perkawinan", "PACARAN"),
        ("kewarganegaraan", "MARS"),
    ],
)
def test_enumerations_outside_the_official_values_are_flagged(name: str, value: str) -> None:
    check = validate_id_card(card(**{name: value})).checks[name]
    assert not check.valid
    assert value in (check.reason or "") and "not one of" in (check.reason or "")


def test_missing_null_and_empty_fields_say_so() -> None:
    data = card(nama=None, pekerjaan="  ")
    del data["agama"]
    data["alamat"] = "JL. MERDEKA"  # not an object
    result = validate_id_card(data)
    assert result.checks["nama"].reason == "not read from the card (null)"
    assert result.checks["pekerjaan"].reason == "empty"
    assert result.checks["agama"].reason == "not read from the card (null)"
    assert not result.checks["alamat.jalan"].valid
    assert set(result.fields["alamat"]) == set(ADDRESS_FIELDS)


def test_a_bad_rt_rw_is_flagged() -> None:
    data = card()
    data["alamat"]["rt_rw"] = "RT 1"
    assert not validate_id_card(data).checks["alamat.rt_rw"].valid


def test_the_schema_requires_every_seed_field_and_fits_a_full_answer() -> None:
    schema = id_card_schema()
    assert schema["required"] == list(FIELDS)
    assert schema["properties"]["alamat"]["required"] == list(ADDRESS_FIELDS)
    assert schema_errors(CARD, schema) == []
    assert schema_errors({**CARD, "nik": None}, schema) == []
    assert schema_errors({k: v for k, v in CARD.items() if k != "nik"}, schema)


def test_the_prompt_asks_for_strict_json_schema_output() -> None:
    fmt = id_card_prompt().response_format()
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"] == id_card_schema()
