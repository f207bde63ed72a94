"""Tiny Qwen2-VL checkpoints whose greedy output is a given text, whatever the prompt.

``build_scripted(text)`` writes a checkpoint like ``build_qwen2_vl()`` (same tokenizer,
processor and config layout; loads with plain transformers and our batching engine), with
hand-set language-model weights so that greedy decoding emits the tokens of ``text`` and
then ``<|im_end|>``. Thinking and tool-calling tests script the model's answer this way.

The construction (one decoder layer, no trained weights):

- **Token codes.** Every token of the script, plus the tail of the generation prompt, gets
  a one-hot code of C dims; all other tokens share one "other" code. An embedding is
  ``[1 (constant) | code | 0 ...]``, so every residual has a known norm.
- **Previous-token heads.** Head h attends to exactly ``h + 1`` positions back, whatever
  the content: its query and key are biases only, and RoPE makes their dot product
  ``A * sum_i cos(theta_i * (distance - h - 1))``, largest at that distance by a margin
  (``_attention_gain``) made 40 logits wide. The head copies that token's code into its own
  slot of the residual. So a position sees its last ``k`` tokens (the context).
- **Lookup MLP.** One neuron per script step fires when its context matches (all codes on:
  ``G * (matches - (m - 0.5))`` through SiLU) and writes the next token's code into the
  output slot; ``lm_head`` reads that slot. Each step uses the shortest context that no
  step with another next token shares, so repeated tokens with different successors work.
- **Fallback.** With no neuron firing, the first script token wins by a small constant
  logit: a prompt whose tail differs from the template's generation prompt still starts
  the script.

Limits: float32 only; a script whose steps cannot be told apart by their contexts within
the known prompt tail (e.g. it starts by repeating the generation prompt's last tokens)
raises ``ValueError``; the first token relies on the prompt ending with the template's
generation prompt (else the fallback applies, which a tail token matching another step's
context can override); ``loop=True`` replaces the final ``<|im_end|>`` by the script's
first token, so greedy decoding repeats the script until ``max_tokens`` (a model stuck in
a loop, as OCR and captioning models get), which needs every script token to be
distinct; after ``<|im_end|>`` (``ignore_eos``) the output is undefined (in practice the
fallback starts the script again); a script that contains ``<|im_end|>``
stops there.
Images in the prompt are fine (the heads look only a few text tokens back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmserve.testing.tiny import (
    TinySpec,
    _add_legacy_rope_keys,
    _processor,
    _qwen2_vl_config,
)
from vlmserve.testing.tiny_cache import build_atomically, cache_root, short_hash
from vlmserve.testing.tiny_tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    QWEN2_VL_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "THINKING_CHAT_TEMPLATE",
    "TOOLS_CHAT_TEMPLATE",
    "ScriptPlan",
    "build_scripted",
    "plan_script",
]

SCRIPTED_FORMAT = 1  # bump when the construction changes: part of the cache key
_ROPE_THETA = 1000000.0
_MIN_HEAD_DIM = 32
_ATTENTION_MARGIN = 40.0  # logits between the attended position and any other
_GATE = 40.0  # neuron pre-activation: +G/2 on a match, <= -G/2 otherwise
_OUT = 10.0  # value written to the output slot by a firing neuron
_READ = 10.0  # lm_head weight on the output slot
_FALLBACK = 1.0  # lm_head weight of the first script token on the constant dim

# A Qwen3-VL-style template (our own rendition of its format): ``tools`` in the system turn,
# assistant ``tool_calls`` as <tool_call> JSON, ``role: tool`` results as <tool_response> in
# a user turn, images/videos as vision tokens, and ``reasoning_content`` of assistant turns
# after the last user query kept in a think block (Qwen3 drops older ones).
_QWEN3_STYLE = r"""
{%- macro render(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is not none -%}{%- for part in content -%}
        {%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
            {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
        {%- elif part.type == 'video' or 'video' in part -%}
            {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
        {%- elif 'text' in part -%}{{- part.text -}}
        {%- endif -%}
    {%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if tools or messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0].role == 'system' -%}
        {{- render(messages[0].content) -}}
        {%- if tools -%}{{- '\n\n' -}}{%- endif -%}
    {%- endif -%}
    {%- if tools -%}
        {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
            'You are provided with function signatures within <tools></tools> XML tags:\n'
            '<tools>' -}}
        {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
        {{- '\n</tools>\n\nFor each function call, return a json object with function name '
            'and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}
{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + m.role + '\n' + render(m.content) + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if m.reasoning_content and loop.index0 > ns.last_user -%}
            {{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- render(m.content) -}}
        {%- for call in m.tool_calls or [] -%}
            {%- if m.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {%- set args = call.function.arguments -%}
            {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' -}}
            {{- (args if args is string else args | tojson) + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render(m.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()
TOOLS_CHAT_TEMPLATE = _QWEN3_STYLE
# The Thinking variant: the generation prompt opens <think> (Qwen3-VL-Thinking), so the
# output starts inside reasoning and closes it with </think>. ``enable_thinking: false``
# (chat_template_kwargs) renders an empty closed block instead, as Qwen3's hybrid template.
THINKING_CHAT_TEMPLATE = _QWEN3_STYLE.replace(
    "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}",
)
if THINKING_CHAT_TEMPLATE == _QWEN3_STYLE:
    raise AssertionError("the thinking generation prompt was not patched in")


@dataclass(frozen=True, slots=True)
class ScriptPlan:
    """What the weights encode: codes, and one (context -> next token) rule per step."""

    tail: tuple[int, ...]  # the token ids every generation prompt ends with
    output: tuple[int, ...]  # the script's token ids, then EOS
    codes: dict[int, int]  # token id -> code index; every other token: code ``other``
    rules: tuple[tuple[tuple[int, ...], int], ...]  # (context, offset 0 = last token; next)

    @property
    def other(self) -> int:
        return len(self.codes)

    @property
    def width(self) -> int:  # C: code dims
        return len(self.codes) + 1

    @property
    def context(self) -> int:  # k: the longest context (k - 1 previous-token heads)
        return max(len(ctx) for ctx, _ in self.rules)


def build_scripted(
    text: str, out_dir: Path | None = None, template: str | None = None, *, loop: bool = False
) -> Path:
    """Build (or find in the cache) a tiny Qwen2-VL checkpoint that greedily emits ``text``.

    ``template``: a chat template saved with the processor (default Qwen2-VL's), e.g.
    ``THINKING_CHAT_TEMPLATE``; the script is keyed to its generation prompt. ``loop``: emit
    ``text`` over and over instead of ending it.
    """
    spec = {"format": SCRIPTED_FORMAT, "text": text, "template": template}
    key = short_hash({**spec, "loop": True} if loop else spec)
    target = Path(out_dir) if out_dir is not None else cache_root() / f"scripted-{key}"
    return build_atomically(
        target, partial(_write_scripted, text, template, loop), what=f"scripted Qwen2-VL {key}"
    )


def plan_script(tail: list[int], output: list[int]) -> ScriptPlan:
    """One rule per output step, each with the shortest context that identifies it.

    Step s sees ``seq[:len(tail) + s]`` with ``seq = tail + output``. Its context of length
    m must differ from the context at every step with another next token; where a context
    would reach past the known tail, it is assumed to match (the prompt is unknown there).
    """
    seq, known = [*tail, *output], len(tail)

    def ctx(step: int, m: int) -> tuple[int, ...]:
        end = known + step
        return tuple(seq[end - 1 - j] for j in range(min(m, end)))

    rules = []
    for s, nxt in enumerate(output):
        for m in range(1, known + s + 1):
            mine = ctx(s, m)
            # another step fires this rule unless a known token differs (ctx(o, m) is
            # shorter than m where step o sees fewer known tokens)
            if all(
                output[o] == nxt or ctx(o, m) != mine[: len(ctx(o, m))] for o in range(len(output))
            ):
                rules.append((mine, nxt))
                break
        else:
            raise ValueError(
                f"cannot script step {s}: its context repeats at a step with another next "
                "token all the way back into the prompt; change the text"
            )
    codes = {token: i for i, token in enumerate(dict.fromkeys(seq))}
    return ScriptPlan(tuple(tail), tuple(output), codes, tuple(dict.fromkeys(rules)))


def prompt_tail(tokenizer: PreTrainedTokenizerBase, template: str) -> list[int]:
    """The token ids that every rendered prompt of ``template`` ends with."""
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        ],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "Describe this image.\n"},
        ],
    ]
    rendered = [
        tokenizer.apply_chat_template(
            c, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        for c in conversations
    ]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in rendered]
    size = 0
    while all(len(i) > size for i in ids) and len({i[-1 - size] for i in ids}) == 1:
        size += 1
    return ids[0][len(ids[0]) - size :]


def _write_scripted(text: str, template: str | None, loop: bool, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    tokenizer = build_tokenizer(TinySpec().vocab_target)
    template = template or QWEN2_VL_CHAT_TEMPLATE
    script = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(script) != text:
        raise ValueError(f"{text!r} does not survive tokenization (NFC?); pass it normalized")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    if loop and len(set(script)) != len(script):
        raise ValueError(f"a looping script needs distinct tokens; {text!r} repeats one")
    last = script[0] if loop else ids[EOS_TOKEN]  # loop: after the script, its start again
    plan = plan_script(prompt_tail(tokenizer, template), [*script, last])
    spec = _spec(plan)
    config = _qwen2_vl_config(spec, ids, vocab_size=len(tokenizer))
    config.tie_word_embeddings = False
    config.get_text_config().tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):  # the vision tower stays seeded-random
        torch.manual_seed(spec.seed)
        model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():
        _set_weights(model, plan)
    _check(model, plan)
    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=None,
        eos_token_id=[ids[EOS_TOKEN], ids[PAD_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
        do_sample=False,
    ).save_pretrained(out)
    processor = _processor(spec, tokenizer)
    processor.chat_template = template
    processor.save_pretrained(out)
    _add_legacy_rope_keys(out / "config.json")


def _spec(plan: ScriptPlan) -> TinySpec:
    """Dimensions that fit the plan: head_dim >= C, hidden >= 1 + C * (k + 1)."""
    width, k = plan.width, plan.context
    head_dim = max(_MIN_HEAD_DIM, 8 * math.ceil(width / 8))
    heads = max(k - 1, math.ceil((1 + width * (k + 1)) / head_dim))
    return TinySpec(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=1,
        num_hidden_layers=1,
        intermediate_size=8 * math.ceil(len(plan.rules) / 8),
    )


def _slot(plan: ScriptPlan, slot: int, token: int | None = None) -> int:
    """Residual index of ``token``'s code in ``slot`` (0: the token itself, 1..k-1: that
    many back, k: the output slot); dim 0 is the constant 1."""
    code = plan.other if token is None else plan.codes.get(token, plan.other)
    return 1 + slot * plan.width + code


def _set_weights(model: Any, plan: ScriptPlan) -> None:
    lm = model.model.language_model
    for param in [*lm.parameters(), model.lm_head.weight]:
        param.zero_()
    hidden, k = lm.config.hidden_size, plan.context
    embed = lm.embed_tokens.weight  # [V, hidden]
    embed[:, 0] = 1.0
    embed[:, _slot(plan, 0)] = 1.0
    for token in plan.codes:
        embed[token, _slot(plan, 0)] = 0.0
        embed[token, _slot(plan, 0, token)] = 1.0
    layer = lm.layers[0]
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, lm.norm):
        norm.weight.fill_(1.0)
    eps = lm.config.rms_norm_eps
    _set_attention(layer.self_attn, plan, rms=math.sqrt(2 / hidden + eps))
    _set_mlp(layer.mlp, plan, rms=math.sqrt((k + 1) / hidden + eps))
    for token in plan.codes:
        model.lm_head.weight[token, _slot(plan, k, token)] = _READ
    model.lm_head.weight[plan.output[0], 0] += _FALLBACK


def _set_attention(attn: Any, plan: ScriptPlan, *, rms: float) -> None:
    """Head h attends h + 1 positions back and copies that token's code to slot h + 1."""
    head_dim, half = attn.head_dim, attn.head_dim // 2
    inv_freq = _inv_freq(head_dim)
    amplitude = math.sqrt(_attention_gain(inv_freq) * math.sqrt(head_dim))
    attn.k_proj.bias[:half] = amplitude  # z_k = a: real
    for h in range(plan.context - 1):
        angle = (h + 1) * inv_freq  # z_q = a * exp(-i * theta * (h + 1))
        rows = slice(h * head_dim, h * head_dim + half)
        attn.q_proj.bias[rows] = amplitude * angle.cos()
        rows = slice(h * head_dim + half, (h + 1) * head_dim)
        attn.q_proj.bias[rows] = -amplitude * angle.sin()
        for code in range(plan.width):
            attn.o_proj.weight[1 + (h + 1) * plan.width + code, h * head_dim + code] = 1.0
    for code in range(plan.width):  # value = the code (undo the input norm's scaling)
        attn.v_proj.weight[code, 1 + code] = rms


def _set_mlp(mlp: Any, plan: ScriptPlan, *, rms: float) -> None:
    """Neuron n fires (SiLU(G/2) ~ G/2) iff rule n's context is in the slots."""
    for n, (context, nxt) in enumerate(plan.rules):
        mlp.gate_proj.weight[n, 0] = -_GATE * (len(context) - 0.5) * rms
        for back, token in enumerate(context):
            mlp.gate_proj.weight[n, _slot(plan, back, token)] = _GATE * rms
        mlp.up_proj.weight[n, 0] = rms  # = 1 after the norm
        mlp.down_proj.weight[_slot(plan, plan.context, nxt), n] = _OUT / (_GATE / 2)


def _inv_freq(head_dim: int) -> torch.Tensor:
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return 1.0 / (_ROPE_THETA**exponents)


def _attention_gain(inv_freq: torch.Tensor, horizon: int = 1 << 15) -> float:
    """A = q.k amplitude such that the target distance wins by ``_ATTENTION_MARGIN`` logits
    (before the 1/sqrt(head_dim) scale) over every other distance up to ``horizon``."""
    import torch

    x = torch.arange(1, horizon, dtype=torch.float64)  # |distance - target| (cos is even)
    gap = float((inv_freq.numel() - torch.cos(x[:, None] * inv_freq).sum(1)).min())
    return _ATTENTION_MARGIN / gap


def _check(model: Any, plan: ScriptPlan) -> None:
    """Teacher-forced: after tail + output[:s], the argmax is output[s] for every s."""
    import torch

    ids = torch.tensor([[*plan.tail, *plan.output[:-1]]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(plan.tail) - 1 :]
    got = logits.argmax(-1).tolist()
    if got != list(plan.output):
        raise RuntimeError(f"scripted weights predict {got}, expected {list(plan.output)}")
