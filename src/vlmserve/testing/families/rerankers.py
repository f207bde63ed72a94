"""Tiny rerankers of both kinds vlmserve scores with (``engine/hf/score``), random or scripted.

- ``jina_reranker``: jina-reranker-m0's layout: a Qwen2-VL checkpoint whose config names
  ``JinaVLForRanking`` and whose weights add the score head (``score.0.*``, ``score.2.*``:
  ``Linear(H, H) -> ReLU -> Linear(H, 1)``), as the real checkpoint holds them.
- ``qwen3_vl_reranker``: Qwen3-VL-Reranker's: a Qwen3-VL checkpoint with an untied LM head,
  ``yes``/``no`` tokens and the Instruct chat template (generation prompt
  ``<|im_start|>assistant\\n``).

Random weights order documents arbitrarily, so each has a *scripted* variant whose ranking is
known: the relevance is the share of `` dog`` tokens (``SCRIPTED_WORD``) in the prompt. Layer
0's attention attends uniformly (q = 0) and copies hidden coordinate 0 (where only that
token's embedding is non-zero) into coordinate 0 of the last position; every other layer's
output projections are zero; the head reads coordinate 0 (jina: the score MLP; Qwen3: the
``yes`` row of the LM head). A document with more of the word (for its length) scores higher;
one without it scores the same as any other without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vlmserve.testing.families import qwen3_vl
from vlmserve.testing.families._common import (
    SPEC,
    family_tokenizer,
    read_template,
    save_checkpoint,
    token_ids,
)
from vlmserve.testing.tiny import build_qwen2_vl
from vlmserve.testing.tiny_cache import MARKER, build_atomically, cache_root, short_hash
from vlmserve.testing.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN

__all__ = ["RERANKERS", "SCRIPTED_WORD", "build_jina_reranker", "build_qwen3_vl_reranker"]

SCRIPTED_WORD = " dog"  # one token of the tiny tokenizer (with its leading space)
_VERSION = 2
_SIGNAL = 10.0  # the scripted token's embedding along coordinate 0
_GAIN = 0.5  # the head's weight on coordinate 0


def _target(name: str, scripted: bool, out_dir: Path | None) -> Path:
    if out_dir is not None:
        return Path(out_dir)
    key = short_hash({"name": name, "scripted": scripted, "version": _VERSION, "spec": repr(SPEC)})
    return cache_root() / f"{name}{'-scripted' if scripted else ''}-{key}"


def build_jina_reranker(out_dir: Path | None = None, *, scripted: bool = False) -> Path:
    """A tiny jina-reranker-m0-layout checkpoint (random or scripted weights)."""
    target = _target("jina-reranker", scripted, out_dir)
    return build_atomically(
        target, lambda out: _write_jina(out, scripted), what=f"tiny jina reranker {target.name}"
    )


def build_qwen3_vl_reranker(out_dir: Path | None = None, *, scripted: bool = False) -> Path:
    """A tiny Qwen3-VL-Reranker-layout checkpoint (random or scripted weights)."""
    target = _target("qwen3-vl-reranker", scripted, out_dir)
    return build_atomically(
        target, lambda out: _write_qwen3(out, scripted), what=f"tiny Qwen3 reranker {target.name}"
    )


def script_relevance(model: Any, token_id: int) -> None:
    """Make coordinate 0 of the last position's final hidden state the share of ``token_id``
    in the prompt (see the module docstring); ``model`` is a Qwen2-VL or Qwen3-VL model."""
    import torch

    language = model.model.language_model
    with torch.no_grad():
        embed = language.embed_tokens.weight
        embed[:, 0] = 0.0
        embed[token_id, 0] = _SIGNAL
        for index, layer in enumerate(language.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj.weight.zero_()
            mlp.down_proj.weight.zero_()
            if index == 0:
                attn.q_proj.weight.zero_()
                if attn.q_proj.bias is not None:
                    attn.q_proj.bias.zero_()
                attn.v_proj.weight.zero_()
                if attn.v_proj.bias is not None:
                    attn.v_proj.bias.zero_()
                attn.v_proj.weight[0, 0] = 1.0
                attn.o_proj.weight[0, 0] = 1.0


def _copy_base(base: Path, out: Path) -> None:
    for item in base.iterdir():
        if item.name != MARKER:
            shutil.copy2(item, out / item.name)


def _write_jina(out: Path, scripted: bool) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    _copy_base(build_qwen2_vl(), out)
    model = Qwen2VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    hidden = model.config.get_text_config().hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SPEC.seed + 1)
        head = torch.nn.Sequential(
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )
    if scripted:
        tokenizer = AutoTokenizer.from_pretrained(out)
        script_relevance(model, _word_id(tokenizer))
        with torch.no_grad():
            for layer in (head[0], head[2]):
                layer.weight.zero_()
                layer.bias.zero_()
            head[0].weight[0, 0] = 1.0
            head[2].weight[0, 0] = _GAIN
    model.save_pretrained(out)
    weights = load_file(str(out / "model.safetensors"))
    weights.update({f"score.{k}": v.contiguous() for k, v in head.state_dict().items()})
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["JinaVLForRanking"]
    config["num_labels"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _word_id(tokenizer: Any) -> int:
    ids = tokenizer(SCRIPTED_WORD, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{SCRIPTED_WORD!r} is {len(ids)} tokens; the script needs one")
    return int(ids[0])


def instruct_template() -> str:
    """Qwen3-VL's chat template with the Instruct models' generation prompt (no ``<think>``),
    which Qwen3-VL-Reranker is built on."""
    thinking = read_template(qwen3_vl.FAMILY)
    generation = "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    if generation not in thinking:
        raise ValueError("the vendored Qwen3-VL template's generation prompt changed")
    return thinking.replace(generation, "{{- '<|im_start|>assistant\\n' }}")


def _write_qwen3(out: Path, scripted: bool) -> None:
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    extra = (*qwen3_vl._EXTRA, "yes", "no")
    tokenizer = family_tokenizer(extra=extra, eos=EOS_TOKEN, pad=PAD_TOKEN)
    names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    eos, pad, image, video, start, end = token_ids(tokenizer, EOS_TOKEN, PAD_TOKEN, *names)
    text = {**qwen3_vl._text(len(tokenizer), pad, eos), "tie_word_embeddings": False}
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=qwen3_vl._vision(),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    unit = (qwen3_vl.PATCH * 2) ** 2
    size = {"shortest_edge": unit * 4, "longest_edge": unit * 64}
    common = {"size": size, "patch_size": qwen3_vl.PATCH, "temporal_patch_size": 2, "merge_size": 2}
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common, image_mean=[0.5] * 3, image_std=[0.5] * 3),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**common, cap_pixels_per_frame=True),
        chat_template=instruct_template(),
    )
    save_checkpoint(
        out,
        model_class=Qwen3VLForConditionalGeneration,
        config=config,
        processor=processor,
        eos_ids=[eos, pad],
        pad_id=pad,
    )
    if scripted:
        _script_yes_no(out, tokenizer)


def _script_yes_no(out: Path, tokenizer: Any) -> None:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    script_relevance(model, _word_id(tokenizer))
    yes, no = token_ids(tokenizer, "yes", "no")
    with torch.no_grad():
        model.lm_head.weight[yes].zero_()
        model.lm_head.weight[no].zero_()
        model.lm_head.weight[yes, 0] = _GAIN
    model.save_pretrained(out)


RERANKERS = {
    "jina_reranker": build_jina_reranker,
    "qwen3_vl_reranker": build_qwen3_vl_reranker,
}
