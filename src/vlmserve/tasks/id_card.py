"""Indonesian ID card (KTP) OCR: the fields KTP clients read, a bounded schema, and post-validation.

The model reads what is printed; this module checks it. Every field gets
``{"valid": bool, "reason": str | None}`` instead of passing garbage on silently:

- ``nik``: 16 digits (spaces dropped); its birth-date part (DDMMYY, day + 40 for women)
  must agree with ``tgl_lahir`` and ``jenis_kelamin`` when those are valid;
- ``tgl_lahir``, ``berlaku_hingga``: a real date, normalised to ISO ``YYYY-MM-DD`` from
  ``DD-MM-YYYY`` (``/``, ``.`` or spaces also accepted); ``berlaku_hingga`` may be ``SEUMUR HIDUP``;
- ``jenis_kelamin``, ``agama``, ``status_perkawinan``, ``kewarganegaraan``: one of the official
  values (common spellings normalised: ``KATHOLIK`` -> ``KATOLIK``, ``L`` -> ``LAKI-LAKI``);
- ``alamat.rt_rw``: ``NNN/NNN`` (zero-padded); other text fields: present and non-empty.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any

from vlmserve.tasks.base import TaskPrompt, schema_instruction

__all__ = [
    "ADDRESS_FIELDS",
    "ENUMS",
    "FIELDS",
    "FieldCheck",
    "IdCardResult",
    "id_card_prompt",
    "id_card_schema",
    "validate_id_card",
]

# field -> maxLength: bounds the answer (and so the tokens constrained decoding can spend)
FIELDS: dict[str, int] = {
    "nik": 24,
    "nama": 60,
    "tempat_lahir": 40,
    "tgl_lahir": 20,
    "jenis_kelamin": 16,
    "alamat": 0,
    "agama": 40,
    "status_perkawinan": 24,
    "pekerjaan": 40,
    "kewarganegaraan": 16,
    "berlaku_hingga": 20,
}
ADDRESS_FIELDS: dict[str, int] = {
    "jalan": 80,
    "rt_rw": 12,
    "kelurahan_desa": 40,
    "kecamatan": 40,
    "kabupaten_kota": 40,
    "provinsi": 40,
}
LIFETIME = "SEUMUR HIDUP"

# canonical value -> the spellings (letters only, upper case) that mean it
ENUMS: dict[str, dict[str, tuple[str, ...]]] = {
    "jenis_kelamin": {
        "LAKI-LAKI": ("LAKILAKI", "LAKI", "L", "PRIA"),
        "PEREMPUAN": ("PEREMPUAN", "P", "WANITA"),
    },
    "agama": {
        "ISLAM": ("ISLAM",),
        "KRISTEN": ("KRISTEN", "PROTESTAN", "KRISTENPROTESTAN"),
        "KATOLIK": ("KATOLIK", "KATHOLIK", "KRISTENKATOLIK"),
        "HINDU": ("HINDU",),
        "BUDDHA": ("BUDDHA", "BUDHA"),
        "KONGHUCU": ("KONGHUCU", "KHONGHUCU"),
        "KEPERCAYAAN TERHADAP TUHAN YME": ("KEPERCAYAANTERHADAPTUHANYME", "KEPERCAYAAN"),
    },
    "status_perkawinan": {
        "BELUM KAWIN": ("BELUMKAWIN",),
        "KAWIN": ("KAWIN",),
        "CERAI HIDUP": ("CERAIHIDUP",),
        "CERAI MATI": ("CERAIMATI",),
        "KAWIN TERCATAT": ("KAWINTERCATAT",),
        "KAWIN BELUM TERCATAT": ("KAWINBELUMTERCATAT",),
    },
    "kewarganegaraan": {"WNI": ("WNI", "INDONESIA"), "WNA": ("WNA",)},
}

_DATE = re.compile(r"^\s*(\d{1,2})\s*[-/. ]\s*(\d{1,2})\s*[-/. ]\s*(\d{4})\s*$")
_ISO = re.compile(r"^\s*(\d{4})-(\d{2})-(\d{2})\s*$")
_RT_RW = re.compile(r"^\s*(\d{1,3})\s*/\s*(\d{1,3})\s*$")


def _text(max_length: int) -> dict[str, Any]:
    return {"type": ["string", "null"], "maxLength": max_length}


def id_card_schema() -> dict[str, Any]:
    """Every seed-003 field, a string or null (unreadable), each with a length bound."""
    address = {
        "type": "object",
        "properties": {k: _text(n) for k, n in ADDRESS_FIELDS.items()},
        "required": list(ADDRESS_FIELDS),
        "additionalProperties": False,
    }
    props = {k: address if k == "alamat" else _text(n) for k, n in FIELDS.items()}
    return {
        "type": "object",
        "properties": props,
        "required": list(FIELDS),
        "additionalProperties": False,
    }


def id_card_prompt(schema: dict[str, Any] | None = None) -> TaskPrompt:
    """The KTP reading prompt; a caller's ``schema`` replaces the built-in one."""
    schema = schema or id_card_schema()
    system = (
        "You read Indonesian identity cards (KTP) and copy the printed values exactly. "
        "NIK: the 16-digit number. Tempat/Tgl Lahir: split into tempat_lahir and tgl_lahir "
        "(DD-MM-YYYY as printed). Alamat: jalan, RT/RW as NNN/NNN, Kel/Desa, Kecamatan, and "
        "the province and regency/city from the card's header. Berlaku Hingga: a date or "
        "SEUMUR HIDUP. Use null for a value you cannot read; never guess. "
        + schema_instruction(schema)
    )
    return TaskPrompt(
        name="id_card",
        system=system,
        instruction="Read this KTP and return its fields.",
        schema=schema,
        max_tokens=1024,
    )


@dataclass(slots=True)
class FieldCheck:
    valid: bool
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"valid": self.valid, "reason": self.reason}


@dataclass(slots=True)
class IdCardResult:
    fields: dict[str, Any]  # normalised where valid, as read where not
    checks: dict[str, FieldCheck] = field(default_factory=dict)  # "nik", "alamat.rt_rw", ...

    @property
    def valid(self) -> bool:
        return all(c.valid for c in self.checks.values())

    def validation(self) -> dict[str, dict[str, Any]]:
        return {name: check.to_dict() for name, check in self.checks.items()}


def _missing(value: Any) -> FieldCheck | None:
    if value is None:
        return FieldCheck(False, "not read from the card (null)")
    if not isinstance(value, str):
        return FieldCheck(False, f"expected text, got {type(value).__name__}")
    if not value.strip():
        return FieldCheck(False, "empty")
    return None


def _check_text(value: Any) -> tuple[Any, FieldCheck]:
    problem = _missing(value)
    return (value, problem) if problem else (" ".join(value.split()), FieldCheck(True))


def _check_nik(value: Any) -> tuple[Any, FieldCheck]:
    problem = _missing(value)
    if problem:
        return value, problem
    digits = re.sub(r"[\s.-]", "", value)
    if not digits.isdigit() or len(digits) != 16:
        return value, FieldCheck(False, f"a NIK is 16 digits; read {value!r}")
    return digits, FieldCheck(True)


def _parse_date(value: str) -> dt.date | None:
    match = _DATE.match(value)
    day, month, year = match.groups() if match else (None, None, None)
    if match is None and (iso := _ISO.match(value)):
        year, month, day = iso.groups()
    if day is None:
        return None
    try:
        return dt.date(int(year), int(month), int(day))  # type: ignore[arg-type]
    except ValueError:
        return None


def _check_date(value: Any, *, lifetime: bool = False) -> tuple[Any, FieldCheck]:
    problem = _missing(value)
    if problem:
        return value, problem
    if lifetime and " ".join(value.upper().split()) == LIFETIME:
        return LIFETIME, FieldCheck(True)
    date = _parse_date(value)
    if date is None:
        allowed = f" or {LIFETIME}" if lifetime else ""
        return value, FieldCheck(False, f"expected a date DD-MM-YYYY{allowed}; read {value!r}")
    if not lifetime and date > dt.date.today():
        return value, FieldCheck(False, f"birth date {date.isoformat()} is in the future")
    return date.isoformat(), FieldCheck(True)


def _check_enum(name: str, value: Any) -> tuple[Any, FieldCheck]:
    problem = _missing(value)
    if problem:
        return value, problem
    key = re.sub(r"[^A-Z]", "", value.upper())
    for canonical, spellings in ENUMS[name].items():
        if key in spellings:
            return canonical, FieldCheck(True)
    allowed = ", ".join(ENUMS[name])
    return value, FieldCheck(False, f"{value!r} is not one of: {allowed}")


def _check_rt_rw(value: Any) -> tuple[Any, FieldCheck]:
    problem = _missing(value)
    if problem:
        return value, problem
    match = _RT_RW.match(value)
    if match is None:
        return value, FieldCheck(False, f"expected RT/RW as NNN/NNN; read {value!r}")
    return f"{int(match.group(1)):03d}/{int(match.group(2)):03d}", FieldCheck(True)


def _nik_agrees(result: IdCardResult) -> None:
    """A NIK's digits 7-12 are the holder's birth date DDMMYY, with DD + 40 for women."""
    checks, fields = result.checks, result.fields
    if not (checks["nik"].valid and checks["tgl_lahir"].valid):
        return
    born = dt.date.fromisoformat(fields["tgl_lahir"])
    day, month, yy = int(fields["nik"][6:8]), int(fields["nik"][8:10]), fields["nik"][10:12]
    female = day > 40
    if checks["jenis_kelamin"].valid and female != (fields["jenis_kelamin"] == "PEREMPUAN"):
        reason = "the NIK's day digits (+40 for women) do not agree with jenis_kelamin"
        checks["nik"] = FieldCheck(False, f"{reason}; one of them was misread")
    elif (day - 40 if female else day, month, yy) != (born.day, born.month, born.strftime("%y")):
        reason = "the NIK's birth-date digits (DDMMYY) do not agree with tgl_lahir"
        checks["nik"] = FieldCheck(False, f"{reason}; one of them was misread")


def _check(name: str, value: Any) -> tuple[Any, FieldCheck]:
    if name == "nik":
        return _check_nik(value)
    if name == "tgl_lahir":
        return _check_date(value)
    if name == "berlaku_hingga":
        return _check_date(value, lifetime=True)
    if name in ENUMS:
        return _check_enum(name, value)
    if name == "rt_rw":
        return _check_rt_rw(value)
    return _check_text(value)


def _check_address(result: IdCardResult, address: Any) -> None:
    address = address if isinstance(address, dict) else {}
    result.fields["alamat"] = {}
    for name in ADDRESS_FIELDS:
        value, check = _check(name, address.get(name))
        result.fields["alamat"][name], result.checks[f"alamat.{name}"] = value, check


def validate_id_card(data: dict[str, Any]) -> IdCardResult:
    """Normalise and check every KTP field of ``data`` (missing keys count as null)."""
    result = IdCardResult(fields={})
    for name in FIELDS:
        if name == "alamat":
            _check_address(result, data.get(name))
        else:
            result.fields[name], result.checks[name] = _check(name, data.get(name))
    _nik_agrees(result)
    return result
