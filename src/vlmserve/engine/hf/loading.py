"""Load a transformers image-text-to-text model and its processor from a directory or hub id."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vlmserve.engine.configs import LoadOptions
from vlmserve.engine.hf.templates import install_chat_template
from vlmserve.engine.models.patch_embed import linear_patch_embeds
from vlmserve.errors import ConfigError

__all__ = [
    "LoadOptions",
    "Loaded",
    "load_model",
    "locate_source",
    "memory_bytes",
    "resolve_device",
    "resolve_dtype",
    "saved_dtype",
    "weight_bytes",
]

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(slots=True)
class Loaded:
    model: Any
    processor: Any
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"device {device!r} asked for, but torch sees no CUDA GPU; use --device cpu"
        )
    return torch.device(device)


def resolve_dtype(
    dtype: str, device: torch.device, saved: torch.dtype | None = None
) -> torch.dtype:
    """The serving dtype. ``auto``: bfloat16 (else float16) on CUDA; on CPU the dtype the
    checkpoint was saved in (``saved``) where the CPU computes it natively (bfloat16 with
    AVX512-BF16 or AMX), else float32 with a log line (half precision without native
    kernels: one decode stream is faster, reading half the bytes, but batches and prefill
    are 2x to several times slower than float32; docs/engine.md, "CPU dtype")."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if saved is None or saved == torch.float32:
        return torch.float32
    if saved == torch.bfloat16 and cpu_has_native_bf16():
        return torch.bfloat16
    log.info(
        "the checkpoint is saved in %s; this CPU has no native %s matmul (AVX512-BF16 or "
        "AMX): serving in float32 (--dtype %s forces it)",
        str(saved).removeprefix("torch."),
        str(saved).removeprefix("torch."),
        str(saved).removeprefix("torch."),
    )
    return torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bfloat16 matmul instructions (x86 AVX512-BF16 or AMX-BF16)."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def saved_dtype(config: Any) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights were saved in (None: not said)."""
    for cfg in (config, getattr(config, "text_config", None)):
        value = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value in _DTYPES:
            return _DTYPES[value]
    return None


def memory_bytes(model: Any) -> int:
    """Bytes held by the model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def load_processor(opts: LoadOptions, local_files_only: bool = False) -> Any:
    """The checkpoint's processor, with ``min_pixels``/``max_pixels`` applied when given.

    Qwen2-VL names its pixel bounds ``size={"shortest_edge", "longest_edge"}`` and refuses a
    ``size`` with only one of them, so a bound not given keeps the checkpoint's own value.
    """
    from transformers import AutoProcessor

    kwargs: dict[str, Any] = {
        "trust_remote_code": opts.trust_remote_code,
        "local_files_only": local_files_only,
    }
    processor = AutoProcessor.from_pretrained(opts.source, **kwargs)
    if opts.min_pixels is None and opts.max_pixels is None:
        return processor
    current = getattr(getattr(processor, "image_processor", None), "size", None)
    size = {
        "shortest_edge": opts.min_pixels or _bound(current, "shortest_edge"),
        "longest_edge": opts.max_pixels or _bound(current, "longest_edge"),
    }
    return AutoProcessor.from_pretrained(opts.source, size=size, **kwargs)


def _bound(size: Any, name: str) -> int | None:
    value = size.get(name) if isinstance(size, dict) else getattr(size, name, None)
    return int(value) if value is not None else None


def _missing_model_error(source: str, exc: Exception) -> ConfigError:
    where = "directory" if os.path.sep in source or source.startswith(".") else "hub repo id"
    return ConfigError(
        f"could not load model {source!r} (as a {where}): {type(exc).__name__}: {exc}. "
        "Offline or behind a firewall? Download the model on a machine with internet "
        "(e.g. `hf download ORG/NAME --local-dir DIR`) and pass --model DIR."
    )


_DOWNLOAD_HINT = (
    "Download it on a machine with internet (`hf download {repo} --local-dir DIR`), copy DIR "
    "here and pass --model DIR."
)


def locate_source(source: str) -> str:
    """Where to load ``source`` from: a local directory (``source`` itself, or the hub cache's
    copy when the hub cannot be reached), or ``source`` as a hub id to download. Raises a
    ConfigError that says what to do, in seconds, when the model cannot be had.

    Why before transformers: ``from_pretrained`` reads a non-existent path as a hub id
    ("Repo id must be in the form ...") and retries an unreachable hub for minutes, file by
    file (even with a complete copy in the cache), before it gives up.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model directory {source!r} has no config.json: it is not a transformers "
                "checkpoint. Download one (`hf download ORG/NAME --local-dir DIR`) and pass "
                "--model DIR."
            )
        return str(path)
    if path.exists():
        raise ConfigError(f"--model {source!r} is a file; pass the checkpoint's directory")
    if not _is_repo_id(source):
        what = "directory" if "/" in source or source.startswith((".", "~")) else "name"
        raise ConfigError(
            f"model {what} {source!r} does not exist (and it is no hub repo id ORG/NAME). Pass "
            "--model an existing checkpoint directory (config.json, *.safetensors) or a hub "
            "repo id."
        )
    unreachable = _hub_unreachable(source)
    if unreachable is None:
        return source
    cached = _cached_snapshot(source)
    if cached is not None:
        log.warning("model hub unreachable (%s); loading %s from the cache", unreachable, source)
        return cached
    raise ConfigError(
        f"cannot reach the model hub to get model {source!r} ({unreachable}), and it is not "
        f"in the local cache; there is no local directory of that name either. "
        + _DOWNLOAD_HINT.format(repo=source)
    )


def _cached_snapshot(repo: str) -> str | None:
    """The hub cache's directory of ``repo`` (its main revision), if it holds a checkpoint."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo, local_files_only=True)
    except (LocalEntryNotFoundError, OSError):
        return None
    return folder if (Path(folder) / "config.json").is_file() else None


def _is_repo_id(source: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if source.startswith(("/", ".", "~")) or "\\" in source or source.count("/") > 1:
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def _hub_unreachable(repo: str) -> str | None:
    """Why the hub cannot be reached (one request, no retries), or None when it answers."""
    from huggingface_hub import constants, model_info
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE
        return "offline mode is on: HF_HUB_OFFLINE=1"
    try:
        model_info(repo, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except HfHubHTTPError:
        return None  # it answered: from_pretrained reports 404s, gated repos and auth
    except Exception as exc:  # refused, DNS, timeout, proxy: whatever the client raises
        return f"{constants.ENDPOINT}: {type(exc).__name__}: {exc}"
    return None


def weight_bytes(source: str) -> int | None:
    """Size of the checkpoint's weight files, when ``source`` is a local directory."""
    path = Path(source)
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) or None


def _human(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _oom_error(source: str, device: torch.device, exc: BaseException) -> ConfigError:
    need = weight_bytes(source)
    needed = f"about {_human(need)} for its weights alone" if need else "more than is free"
    free = ""
    if device.type == "cuda":
        free_b, total_b = torch.cuda.mem_get_info(device)
        free = f"; {free_b / 2**30:.1f} of {total_b / 2**30:.1f} GiB were free on {device}"
    return ConfigError(
        f"out of memory loading model {source!r} on {device}: it needs {needed}{free}. "
        "Use a smaller or quantised model, --dtype bfloat16, another --device, or fewer models "
        f"per server ({type(exc).__name__})"
    )


# transformers' quantization methods -> the package that runs them (what to pip install)
QUANT_PACKAGES = {
    "torchao": ("torchao", "torchao"),
    "bitsandbytes": ("bitsandbytes", "bitsandbytes"),
    "gptq": ("gptqmodel", "gptqmodel"),
    "awq": ("gptqmodel", "gptqmodel"),
    "compressed-tensors": ("compressed_tensors", "compressed-tensors"),
}


def check_quantization(source: str, config_path: Path) -> None:
    """A quantized checkpoint whose package is missing fails here, naming what to install
    (transformers would fail later, deep in loading, or fall back silently)."""
    import importlib.util
    import json

    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return  # from_pretrained reports a missing or broken config
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method is None or method not in QUANT_PACKAGES:
        return
    module, package = QUANT_PACKAGES[method]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"model {source!r} is quantized with {method}, whose package is not installed: "
            f"pip install {package}"
        )


def _saved(opts: LoadOptions, local: bool) -> torch.dtype | None:
    if opts.dtype != "auto" or not local:
        return None  # a hub id: its config is read by from_pretrained anyway
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        opts.source, trust_remote_code=opts.trust_remote_code, local_files_only=True
    )
    return saved_dtype(config)


def load_model(opts: LoadOptions) -> Loaded:
    """Load processor and model; raises ConfigError naming the model when that is impossible."""
    from transformers import AutoModelForImageTextToText

    device = resolve_device(opts.device)
    located = replace(opts, source=locate_source(opts.source))
    local = Path(located.source).is_dir()
    if local:
        check_quantization(opts.source, Path(located.source) / "config.json")
    try:
        dtype = resolve_dtype(opts.dtype, device, _saved(located, local))
        processor = load_processor(located, local_files_only=local)
        if opts.chat_template is not None:
            install_chat_template(processor, opts.chat_template, opts.source)
        model = AutoModelForImageTextToText.from_pretrained(
            located.source,
            dtype=dtype,
            attn_implementation=opts.attn_implementation,
            trust_remote_code=opts.trust_remote_code,
            local_files_only=local,
        )
        linear_patch_embeds(model)  # the Qwen towers' Conv3d as the GEMM it is
        model.to(device)
    except torch.OutOfMemoryError as exc:
        raise _oom_error(opts.source, device, exc) from exc
    except (OSError, ValueError) as exc:
        raise _missing_model_error(opts.source, exc) from exc
    model.eval()
    log.info(
        "loaded %s on %s (%s): %.1f MiB of weights",
        opts.source,
        device,
        str(dtype).removeprefix("torch."),
        memory_bytes(model) / 2**20,
    )
    return Loaded(model=model, processor=processor, device=device, dtype=dtype)
