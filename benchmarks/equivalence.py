"""Same greedy requests, same tiny checkpoints: does vlmserve answer as vLLM does?

    python benchmarks/equivalence.py --peer vllm                       # every family
    python benchmarks/equivalence.py --peer vllm --family qwen2_vl --concurrency 4 --json out.json

For each family's tiny checkpoint (``vlmserve.testing.families``, float32), vlmserve and the
peer (vLLM's CPU build, ``bash benchmarks/peers/install_vllm.sh``) are started one after the
other and sent the same greedy requests (text, one image, two images, and a video at the
family's default frame choice where the family takes video; ``ignore_eos``, ``logprobs`` with
the top 2): first one at a time, then ``--concurrency`` at once (each case ``--repeat`` times).
Compared per request: the tokens (the bytes of each logprob entry), ``usage.prompt_tokens``
and the chosen tokens' logprobs; where the tokens part at a step whose top-2 gap is under 1e-3
it is a near-tie, reported apart. Each server's concurrent answers are also compared with its
own one-at-a-time answers (batch invariance). Video answers are compared besides with
transformers' ``generate`` on the frames vlmserve chose (``--no-generate`` skips it): vLLM's
video path for Qwen2-VL and Qwen2.5-VL departs from transformers'. Gemma 3 is left out: its tiny
tokenizer has no ``\\n`` token, which vLLM needs. Correctness only: no timing is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.equivalence import Answer, Verdict, cases, compare, read_answer
from peers.servers import Server, ServerSpec, free_ports, vllm_spec, vlmserve_spec

FAMILIES = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "llava_onevision",
    "idefics3",
    "smolvlm",
    "internvl",
]
EXCLUDED = {"gemma3": "its tiny tokenizer has no '\\n' token, which vLLM's Gemma 3 needs"}
VIDEO = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "smolvlm", "internvl"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peer", choices=["vllm"], default="vllm")
    p.add_argument("--family", action="append", choices=FAMILIES, help="default: all")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--repeat", type=int, default=3, help="copies of each case sent concurrently")
    p.add_argument("--no-generate", action="store_true", help="skip transformers' generate")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="write every verdict here")
    p.add_argument("--peers-dir", type=Path, default=Path.home() / ".cache/vlmserve/peers")
    return p.parse_args(argv)


def body(messages: list[dict[str, Any]], model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }


async def ask(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> Answer:
    r = await client.post(url + "/v1/chat/completions", json=payload)
    try:
        data = r.json()
    except ValueError:
        data = {"error": {"message": r.text[:200]}}
    return read_answer(r.status_code, data)


async def answers(
    spec: ServerSpec, requests: dict[str, dict[str, Any]], ns: argparse.Namespace
) -> dict[str, Any]:
    """One at a time, then ``concurrency`` at once (``repeat`` copies of each case)."""
    async with httpx.AsyncClient(timeout=600) as client:
        alone = {name: await ask(client, spec.url, b) for name, b in requests.items()}
        gate = asyncio.Semaphore(ns.concurrency)

        async def one(name: str) -> tuple[str, Answer]:
            async with gate:
                return name, await ask(client, spec.url, requests[name])

        jobs = [one(name) for name in requests for _ in range(ns.repeat)]
        together = await asyncio.gather(*jobs)
    return {"alone": alone, "together": together}


def run_server(
    spec: ServerSpec, requests: dict[str, dict[str, Any]], ns: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    if spec.missing:
        raise RuntimeError(spec.missing)
    server = Server(spec, logs)
    try:
        server.start(ns.start_timeout)
        return asyncio.run(answers(spec, requests, ns))
    finally:
        server.stop()


def generate_pieces(model_dir: Path, messages: list[dict[str, Any]], max_tokens: int) -> list[str]:
    """transformers' ``generate`` on the frames vlmserve picks (its family's rule): each new
    token's text, as a logprob entry names it."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmserve.engine.hf.inputs import build_inputs
    from vlmserve.engine.hf.media_options import family_media
    from vlmserve.engine.types import (
        ChatMessage,
        GenerateRequest,
        SamplingParams,
        TextPart,
        VideoPart,
    )
    from vlmserve.media import MediaPolicy, decode_video
    from vlmserve.media.video import source_fps

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype="float32").eval()
    _, rule = family_media(model, processor)
    url = messages[0]["content"][0]["video_url"]["url"]
    import base64

    clip = decode_video(
        base64.b64decode(url.split(",", 1)[1]), MediaPolicy(max_video_frames=16), sampling=rule
    )
    part = VideoPart(clip.frames, source_fps(clip), clip.frame_indices, clip.source_frames)
    text = messages[0]["content"][1]["text"]
    request = GenerateRequest("g", [ChatMessage("user", [part, TextPart(text)])], SamplingParams())
    inputs = build_inputs(processor, request).inputs
    import torch

    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
        )
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    return [str(processor.tokenizer.decode([t])) for t in new]


def verdicts(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "alone": {},
        "together": [],
        "invariant": {"vlmserve": True, "peer": True},
    }
    for name, answer in ours["alone"].items():
        out["alone"][name] = compare(answer, theirs["alone"][name])
    for (name, a), (_, b) in zip(ours["together"], theirs["together"], strict=True):
        out["together"].append((name, compare(a, b)))
    for who, got in (("vlmserve", ours), ("peer", theirs)):
        out["invariant"][who] = all(
            compare(a, got["alone"][name]).same_tokens for name, a in got["together"]
        )
    return out


def family_report(family: str, ns: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from vlmserve.testing.families import FAMILIES as BUILDERS

    model_dir = BUILDERS[family]()
    messages = cases(family in VIDEO)
    port_a, port_b = free_ports(2)
    specs = [
        vlmserve_spec(str(model_dir), port_a, "float32"),
        vllm_spec(str(model_dir), port_b, "float32", ns.peers_dir),
    ]
    requests = [{n: body(m, s.model, ns.max_tokens) for n, m in messages.items()} for s in specs]
    report: dict[str, Any] = {"family": family}
    try:
        ours = run_server(specs[0], requests[0], ns, logs)
        theirs = run_server(specs[1], requests[1], ns, logs)
    except Exception as exc:  # a peer that cannot load the family is a finding, not a crash
        report["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return report
    report.update(verdicts(ours, theirs))
    report["texts"] = {n: (a.text, theirs["alone"][n].text) for n, a in ours["alone"].items()}
    report["first_tokens"] = {
        n: ([t.hex() for t in a.tokens[:3]], [t.hex() for t in theirs["alone"][n].tokens[:3]])
        for n, a in ours["alone"].items()
    }
    report["prompt_tokens"] = {
        n: (a.prompt_tokens, theirs["alone"][n].prompt_tokens) for n, a in ours["alone"].items()
    }
    if "video" in messages and not ns.no_generate:
        reference = generate_pieces(model_dir, messages["video"], ns.max_tokens)
        report["video_equals_generate"] = ours["alone"]["video"].pieces == reference
    return report


def _mark(v: Verdict) -> str:
    if v.same_tokens:
        return "same"
    return "near-tie" if v.near_tie else f"differs@{v.diverged_at}"


def print_report(report: dict[str, Any]) -> None:
    family = report["family"]
    if "error" in report:
        print(f"{family:16} not compared: {report['error']}")
        return
    for name, v in report["alone"].items():
        ours, theirs = report["prompt_tokens"][name]
        prompt = "same" if v.same_prompt else f"{ours} vs {theirs}"
        print(
            f"{family:16} {name:11} tokens {_mark(v):12} prompt {prompt:12} "
            f"max |dlogprob| {v.max_logprob_diff:.2e}"
        )
    together = report["together"]
    same = sum(v.same_tokens for _, v in together)
    ties = sum(v.near_tie for _, v in together)
    print(
        f"{family:16} concurrent  {same}/{len(together)} same tokens ({ties} near-ties); "
        f"batch-invariant: {report['invariant']}"
    )
    if "video_equals_generate" in report:
        print(
            f"{family:16} video       vlmserve == transformers generate: "
            f"{report['video_equals_generate']}"
        )


def _jsonable(report: dict[str, Any]) -> dict[str, Any]:
    def conv(x: Any) -> Any:
        if isinstance(x, Verdict):
            return {k: getattr(x, k) for k in x.__slots__}
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [conv(v) for v in x]
        return x

    return conv(report)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    for family, why in EXCLUDED.items():
        print(f"{family:16} excluded: {why}")
    logs = Path(tempfile.mkdtemp(prefix="vlmserve-equivalence-"))
    reports = []
    for family in ns.family or FAMILIES:
        report = family_report(family, ns, logs)
        print_report(report)
        reports.append(_jsonable(report))
    print(f"server logs: {logs}")
    if ns.json:
        ns.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(ns).items()}, "families": reports}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
