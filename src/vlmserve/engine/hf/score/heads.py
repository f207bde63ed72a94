"""What turns a reranker's last hidden state into a relevance score, chosen from the checkpoint.

- ``jina``: the checkpoint's architecture is ``JinaVLForRanking`` (jina-reranker-m0): a
  Qwen2-VL backbone, loaded as transformers' own ``Qwen2VLForConditionalGeneration``, and the
  score head its ``modeling.py`` adds, rebuilt here (no remote code):
  ``Linear(H, H) -> ReLU -> Linear(H, 1)`` on the last token's final hidden state, whose
  weights are the checkpoint's ``score.0.*`` and ``score.2.*``; the score is
  ``sigmoid(logit - 2.65)`` as its ``compute_score`` (and vLLM) normalise it.
- ``yes_no``: any generative VLM whose tokenizer has single ``yes`` and ``no`` tokens
  (Qwen3-VL-Reranker): P(yes) over {no, yes} at the last position, which is
  ``sigmoid(h . (w_yes - w_no))`` with ``w`` the LM head's rows; one dot product instead of
  the full vocabulary's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmserve.engine.hf.score.prompts import JINA, YES_NO
from vlmserve.errors import ConfigError

__all__ = ["JINA_ARCHITECTURE", "JINA_LOGIT_BIAS", "ScoreHead", "load_head", "score_kind"]

JINA_ARCHITECTURE = "JinaVLForRanking"
JINA_LOGIT_BIAS = 2.65  # modeling.py's LOGIT_BIAS: score = sigmoid(logit - 2.65)


@dataclass(slots=True)
class ScoreHead:
    """``kind`` (``jina`` | ``yes_no``) and ``module``: [B, H] final hidden states -> [B]
    logits; ``bias`` is subtracted before the sigmoid."""

    kind: str
    module: torch.nn.Module
    bias: float = 0.0

    def __call__(self, last: torch.Tensor) -> torch.Tensor:
        """Relevance in (0, 1) for each row of ``last`` ([B, H]), float32: [B]."""
        logits = self.module(last.to(next(self.module.parameters()).dtype)).squeeze(-1)
        return torch.sigmoid(logits.float() - self.bias)


def score_kind(model: Any, tokenizer: Any) -> str:
    """``jina`` or ``yes_no`` for a loaded checkpoint; ConfigError when it is neither."""
    architectures = getattr(model.config, "architectures", None) or []
    if JINA_ARCHITECTURE in architectures:
        return JINA
    vocab = tokenizer.get_vocab()
    if "yes" in vocab and "no" in vocab and model.get_output_embeddings() is not None:
        return YES_NO
    raise ConfigError(
        f"{type(model).__name__} is not a reranker vlmserve knows: it has neither the "
        f"{JINA_ARCHITECTURE} score head (jina-reranker-m0) nor an LM head with 'yes' and 'no' "
        "tokens (Qwen3-VL-Reranker); serve it with another role"
    )


def load_head(model: Any, tokenizer: Any, source: str) -> ScoreHead:
    """The score head of the loaded reranker ``model`` (weights read from ``source``)."""
    kind = score_kind(model, tokenizer)
    if kind == JINA:
        return ScoreHead(JINA, _jina_module(model, source), JINA_LOGIT_BIAS)
    return ScoreHead(YES_NO, _yes_no_module(model, tokenizer))


def _yes_no_module(model: Any, tokenizer: Any) -> torch.nn.Module:
    vocab = tokenizer.get_vocab()
    head = model.get_output_embeddings()
    weight = head.weight.detach()
    linear = torch.nn.Linear(weight.shape[1], 1, bias=False, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight[0] = weight[vocab["yes"]] - weight[vocab["no"]]
    return linear.to(weight.device).eval()


def _checkpoint_dir(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, allow_patterns=["*.safetensors", "*.json"]))


def _score_tensors(source: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(_checkpoint_dir(source).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key.startswith("score."):
                    found[key] = f.get_tensor(key)
    return found


def _jina_module(model: Any, source: str) -> torch.nn.Module:
    tensors = _score_tensors(source)
    names = ("score.0.weight", "score.0.bias", "score.2.weight", "score.2.bias")
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ConfigError(
            f"{source!r} says {JINA_ARCHITECTURE} but its weights lack {', '.join(missing)}; "
            "it is not a complete jina-reranker-m0 checkpoint"
        )
    hidden = tensors["score.0.weight"].shape[1]
    labels = tensors["score.2.weight"].shape[0]
    embed = model.get_input_embeddings().weight
    head = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, labels)
    )
    head.load_state_dict({k.removeprefix("score."): v for k, v in tensors.items()})
    return head.to(device=embed.device, dtype=embed.dtype).eval()
