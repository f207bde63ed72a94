"""The tables and ratios of benchmarks/gpu.py (results in, text out; no torch)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ["ratios", "table"]


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    """Each vlmserve figure over its plain-transformers one; TPOTs over the bandwidth floor."""
    tpot, tok, emb = result["tpot_ms"], result["tokens_per_s"], result["embed_images_per_s"]
    base = tok["hf_generate_one_at_a_time"]
    out = {
        "hf_tpot_over_floor": _ratio(tpot["hf_generate"], tpot["bandwidth_floor"]),
        "vlmserve_tpot_over_floor": _ratio(tpot["vlmserve"], tpot["bandwidth_floor"]),
        "vlmserve_tpot_over_hf": _ratio(tpot["vlmserve"], tpot["hf_generate"]),
        "vlmserve_embed_over_hf": _ratio(emb["vlmserve"], emb["hf_one_per_forward"]),
    }
    for c, rate in tok["vlmserve"].items():
        out[f"vlmserve_tokens_c{c}_over_hf"] = _ratio(rate, base)
    for name, ctx in result["contexts"].items():
        out[f"vlmserve_tpot_{name}_over_floor"] = _ratio(ctx["tpot_ms"], ctx["floor_ms"])
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None  # None: too fast to time (only seen with --tiny)


def _fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.2f}{unit}"


def table(result: dict[str, Any]) -> Table:
    tpot, tok, emb = result["tpot_ms"], result["tokens_per_s"], result["embed_images_per_s"]
    r, bandwidth = result["ratios"], result["copy_bandwidth_gb_s"]
    title = f"vlmserve hf engine vs plain transformers ({result['mode']}, {result['device']})"
    out = Table(title=f"{title}\ncopy bandwidth {bandwidth:.1f} GB/s")
    for name in ("metric", "HF one at a time", "vlmserve", "vlmserve / HF", "note"):
        out.add_column(name, justify="left" if name in ("metric", "note") else "right")
    floor = (
        f"floor {tpot['bandwidth_floor']:.3f} ms: HF {_fmt(r['hf_tpot_over_floor'], 'x')}, "
        f"vlmserve {_fmt(r['vlmserve_tpot_over_floor'], 'x')}"
    )
    ms = (f"{tpot['hf_generate']:.2f}", f"{tpot['vlmserve']:.2f}")
    out.add_row("TPOT ms, 1 request", *ms, _fmt(r["vlmserve_tpot_over_hf"]), floor)
    base = f"{tok['hf_generate_one_at_a_time']:.1f}"
    for name, ctx in result["contexts"].items():
        label = f"{name} ({ctx['prompt_tokens']} tok)"
        if name != "short":
            over = _fmt(r[f"vlmserve_tpot_{name}_over_floor"], "x")
            note = f"floor {ctx['floor_ms']:.3f} ms: {over}"
            out.add_row(f"TPOT ms, 1 request, {label}", "", f"{ctx['tpot_ms']:.2f}", "", note)
        for c, rate in ctx["tokens_per_s"].items():
            hf = base if name == "short" else ""
            ratio = _fmt(r[f"vlmserve_tokens_c{c}_over_hf"]) if name == "short" else ""
            note = f"floor {ctx['floor_tokens_per_s'][c]:,.0f} tok/s" + (
                "; HF: in turn" if hf else ""
            )
            out.add_row(f"output tok/s, {label}, c={c}", hf, f"{rate:.1f}", ratio, note)
    rates = (f"{emb['hf_one_per_forward']:.1f}", f"{emb['vlmserve']:.1f}")
    size, ratio = emb["image_size"], _fmt(r["vlmserve_embed_over_hf"])
    out.add_row(f"embed images/s, {size}x{size}", *rates, ratio, "HF: one per forward")
    phases = ", ".join(f"{k} {v:.0f}s" for k, v in result["phases_s"].items())
    out.caption = f"phases: {phases}"
    return out
