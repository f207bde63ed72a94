"""Apply a PEFT LoRA adapter to a loaded base model, refusing adapters made for another base.

What this guards against: VLM2Vec-LoRA (made for Phi-3.5-vision) loaded on Qwen2-VL-2B. peft
only *warns* about the missing keys and yields an adapter that does nothing, so the embeddings
silently come from the bare base. Two checks refuse that with a ``ConfigError``:

1. before loading, ``adapter_config.json`` (local dir, or the Hub cache; never downloaded
   here) names its base: same path / repo id -> fine; otherwise the base architectures are
   compared where knowable (``auto_mapping.base_model_class`` or the named base's
   ``config.json``), and failing that, the model families its name mentions;
2. after loading, every LoRA layer must have received weights (``lora_B`` is zero-initialised,
   so an all-zero ``lora_B`` means the adapter had nothing for that layer).
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmserve.errors import ConfigError

__all__ = ["BaseInfo", "apply_adapter", "base_info", "check_adapter_base", "read_adapter_config"]

log = logging.getLogger(__name__)

_HINT = (
    "use an adapter trained for this base (for Qwen2-VL-2B: VLM2Vec-Qwen2VL-2B, not VLM2Vec-LoRA)"
)
# Model families recognisable in a repo name, for when no architecture is known.
_FAMILIES = re.compile(
    "qwen|phi|llava|llama|gemma|idefics|smolvlm|internvl|mistral|pixtral|florence|blip|molmo"
    "|minicpm|deepseek|glm|chameleon|janus"
)


@dataclass(slots=True, frozen=True)
class BaseInfo:
    """What is known about the base model being loaded."""

    source: str
    names: frozenset[str]  # normalised: the source, its resolved path, names found in config.json
    arch: str  # the loaded class, e.g. Qwen2VLForConditionalGeneration
    model_type: str = ""


def _norm(name: str) -> str:
    return name.strip().rstrip("/").lower()


def _hub_id_from_cache_path(path: Path) -> str | None:
    """``.../models--Qwen--Qwen2-VL-2B-Instruct/snapshots/<sha>`` -> the repo id."""
    for part in path.parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/")
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cached_hub_file(repo_id: str, filename: str) -> Path | None:
    """A file of a Hub repo if it is already in the local cache; never downloads."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename)
    except Exception:  # not a valid repo id, or no huggingface_hub: nothing cached
        return None
    return Path(found) if isinstance(found, str) else None


def _config_file(name: str, filename: str) -> Path | None:
    local = Path(name).expanduser()
    if local.is_dir():
        return local / filename if (local / filename).is_file() else None
    return _cached_hub_file(name, filename)


def base_info(source: str, model: Any) -> BaseInfo:
    names = {_norm(source)}
    local = Path(source).expanduser()
    if local.is_dir():
        resolved = local.resolve()
        names.add(_norm(str(resolved)))
        if hub_id := _hub_id_from_cache_path(resolved):
            names.add(_norm(hub_id))
    config = _read_json(p) if (p := _config_file(source, "config.json")) else None
    if config and isinstance(config.get("_name_or_path"), str) and config["_name_or_path"]:
        names.add(_norm(config["_name_or_path"]))
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    return BaseInfo(source, frozenset(names), type(model).__name__, model_type)


def read_adapter_config(adapter: str) -> dict[str, Any] | None:
    """``adapter_config.json`` of a local adapter dir or a cached Hub adapter; else None."""
    path = _config_file(adapter, "adapter_config.json")
    return _read_json(path) if path else None


def _adapter_arch(config: dict[str, Any]) -> str | None:
    mapping = config.get("auto_mapping") or {}
    if isinstance(mapping, dict) and mapping.get("base_model_class"):
        return str(mapping["base_model_class"])
    name = config.get("base_model_name_or_path")
    base_config = _read_json(p) if name and (p := _config_file(name, "config.json")) else None
    archs = (base_config or {}).get("architectures") or []
    return str(archs[0]) if archs else None


def _arch_stem(arch: str) -> str:
    """Qwen2VLForConditionalGeneration / Qwen2VLModel -> qwen2vl (the family, not the head)."""
    return re.sub(r"(For[A-Z]\w*|Model)$", "", arch).lower()


def _families(text: str) -> set[str]:
    flat = re.sub(r"[^a-z0-9]", "", text.lower())
    return set(_FAMILIES.findall(flat))


def _same_name(adapter_base: str, base: BaseInfo) -> bool:
    candidates = {_norm(adapter_base)}
    local = Path(adapter_base).expanduser()
    if local.is_dir():
        candidates.add(_norm(str(local.resolve())))
    if candidates & base.names:
        return True
    # A repo id vs a local copy named after it: Qwen/Qwen2-VL-2B-Instruct vs /m/Qwen2-VL-2B-Instruct
    tail = _norm(adapter_base).rsplit("/", 1)[-1]
    return bool(tail) and any(name.rsplit("/", 1)[-1] == tail for name in base.names)


def _mismatch_message(adapter: str, config: dict[str, Any], base: BaseInfo) -> str:
    adapter_base = config.get("base_model_name_or_path") or "an unnamed base"
    arch = _adapter_arch(config) or "architecture unknown"
    return (
        f"adapter {adapter} was made for base {adapter_base!r} ({arch}), but the model being "
        f"loaded is {base.source!r} ({base.arch})"
    )


def check_adapter_base(adapter: str, config: dict[str, Any], base: BaseInfo) -> bool:
    """Raise ``ConfigError`` when the adapter's config clearly names a different base.

    Returns True when it names this base (by name or architecture), False when that cannot
    be told (no name, or an unrelated name with no known architecture).
    """
    adapter_base = config.get("base_model_name_or_path")
    if not adapter_base:
        return False
    if _same_name(adapter_base, base):
        return True
    arch = _adapter_arch(config)
    if arch is not None:
        if _arch_stem(arch) != _arch_stem(base.arch):
            raise ConfigError(f"{_mismatch_message(adapter, config, base)}; {_HINT}")
        log.info("adapter %s names base %r (%s): same architecture", adapter, adapter_base, arch)
        return True
    named = _families(adapter_base)
    ours = _families(" ".join([base.arch, base.model_type, *base.names]))
    if named and ours and not named & ours:
        raise ConfigError(f"{_mismatch_message(adapter, config, base)}; {_HINT}")
    log.warning(
        "adapter %s names base %r, not %r; cannot tell whether they match, so its "
        "weights are checked after loading",
        adapter,
        adapter_base,
        base.source,
    )
    return False


def _empty_lora_layers(peft_model: Any) -> tuple[list[str], int]:
    """LoRA layers whose ``lora_B`` stayed all-zero (no weights loaded), and the layer count."""
    empty, total = [], 0
    for name, module in peft_model.named_modules():
        lora_b = getattr(module, "lora_B", None)
        if lora_b is None or not hasattr(lora_b, "values"):
            continue
        for layer in lora_b.values():
            total += 1
            if not layer.weight.detach().any():
                empty.append(name)
    return empty, total


def _load_peft(model: Any, adapter: str, message: str) -> Any:
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # peft's "missing adapter keys" is checked below instead
        try:
            peft_model = PeftModel.from_pretrained(model, adapter, is_trainable=False)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise ConfigError(
                f"could not apply adapter {adapter}: {type(exc).__name__}: {exc}. "
                f"({message}.) Offline? Download it (`hf download ORG/NAME --local-dir DIR`) "
                "and pass the directory"
            ) from exc
    for warning in caught:
        log.debug("peft: %s", warning.message)
    return peft_model


def _merge(peft_model: Any, adapter: str) -> Any:
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            return peft_model.merge_and_unload()
        except (ValueError, RuntimeError, NotImplementedError, TypeError) as exc:
            log.warning("adapter %s cannot be merged (%s); running it unmerged", adapter, exc)
            return peft_model.get_base_model()  # the LoRA layers live inside the base model


def apply_adapter(model: Any, adapter: str, source: str) -> Any:
    """Check, apply and (when possible) merge ``adapter``; return the model to run."""
    base = base_info(source, model)
    config = read_adapter_config(adapter)
    if config is not None:
        check_adapter_base(adapter, config, base)
    elif Path(adapter).expanduser().is_absolute() or adapter.startswith("."):
        raise ConfigError(f"adapter directory {adapter} not found or has no adapter_config.json")
    peft_model = _load_peft(model, adapter, f"base being loaded: {source!r} ({base.arch})")
    if config is None:  # a Hub adapter fetched just now: check what it says about its base
        config = peft_model.peft_config["default"].to_dict()
        check_adapter_base(adapter, config, base)
    empty, total = _empty_lora_layers(peft_model)
    if empty:
        raise ConfigError(
            f"{_mismatch_message(adapter, config, base)}: {len(empty)} of {total} LoRA layers got "
            f"no weights from the adapter (e.g. {empty[0]}); {_HINT}"
        )
    log.info("applied adapter %s to %s (%d LoRA layers)", adapter, source, total)
    return _merge(peft_model, adapter)
