"""A small byte-level BPE tokenizer with the Qwen2-VL special tokens and chat template.

The tokenizer is trained locally (no hub) on ``CORPUS`` with the same pipeline the
real Qwen2 tokenizer uses (NFC, the Qwen2 split regex, byte-level alphabet and
decoder), so every string is encodable and multi-byte characters ("中文", "😀")
become several byte tokens, exactly the case streaming detokenizers must handle.
The special tokens follow the BPE vocabulary in the real order, so their ids are
``vocab_size + 0 .. vocab_size + 13`` (the real checkpoint: 151643 .. 151656).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CORPUS", "QWEN2_VL_CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer"]

# Order matters: ids are assigned in this order, as in Qwen2-VL's tokenizer.json.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Verbatim from Qwen/Qwen2-VL-2B-Instruct (chat_template.json).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The Qwen2 pre-tokenizer split (transformers' models/qwen2/tokenization_qwen2.py).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CORPUS: tuple[str, ...] = (
    "You are a helpful assistant. The user asks a question and the assistant answers it.",
    "system\nuser\nassistant\nDescribe this image. What is shown in this video? Describe the "
    "scene in one sentence. Caption: a red square on a white background.",
    "The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, and a "
    "video is worth many pictures. The camera moves slowly from left to right.",
    "In the morning the market opens at 7:30 and closes at 18:45. Prices rose by 12.5% in 2023 "
    "and fell by 3.2% in 2024. Call +62 812-3456-7890 or write to info@example.com.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 4096 65536 3.14159 2.71828 -17",
    '{"name": "Budi Santoso", "age": 34, "city": "Jakarta", "tags": ["a", "b"], "ok": true}',
    '{"entities": [{"text": "Paris", "type": "LOC"}, {"text": "Marie Curie", "type": "PER"}]}',
    '[{"subject": "Marie Curie", "predicate": "born_in", "object": "Warsaw"}, null, false]',
    '{"caption": "two cats on a sofa", "objects": [{"label": "cat", "box": [12, 40, 96, 120]}]}',
    "Nama: Budi Santoso\nNIK: 3171234567890001\nTempat/Tgl Lahir: Jakarta, 17-08-1990\n"
    "Jenis Kelamin: Laki-laki\nAlamat: Jl. Merdeka No. 10\nRT/RW: 003/005\nKel/Desa: Gambir\n"
    "Kecamatan: Gambir\nAgama: Islam\nStatus Perkawinan: Kawin\nPekerjaan: Karyawan Swasta\n"
    "Kewarganegaraan: WNI\nBerlaku Hingga: Seumur Hidup\nGolongan Darah: O",
    "Provinsi DKI Jakarta. Kartu Tanda Penduduk. Selamat pagi, apa kabar? Terima kasih banyak. "
    "Saya tinggal di Bandung dan bekerja di Surabaya.",
    "Café, naïve, résumé, über, Müller, São Paulo, España, garçon, déjà vu, crème brûlée.",
    "中文 文本 图像 视频 你好 世界。日本語 テキスト。한국어. Привет, мир! Γειά σου.",
    "Emoji: 😀 😃 🎉 👍 🐱 🚀 ❤️ ✅ — and symbols: © ® ™ € £ ¥ ° ± × ÷ → ← ≤ ≥.",
    "def main(argv: list[str]) -> int:\n    for i in range(10):\n        print(i, argv[i % 2])\n"
    "    return 0\n",
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name LIMIT 10; -- a query",
    "Once upon a time there was a small robot who liked to paint. Every day it painted the sky, "
    "the sea and the mountains. People came from far away to see its pictures, and the robot "
    "was happy. One day it ran out of blue paint, so it painted the sky green instead.",
    "The weather today is sunny with a light breeze. Tomorrow there will be rain in the north "
    "and clouds in the south. Temperatures range from 18 to 27 degrees Celsius.",
    "Question: How many people are in the image? Answer: There are three people standing "
    "near a blue car. Question: What color is the car? Answer: The car is blue.",
    "Extract the entities from the text and return them as JSON. Extract the triples "
    "(subject, predicate, object). Read the identity card and fill in every field.",
)


def build_tokenizer(vocab_target: int) -> PreTrainedTokenizerBase:
    """Train the BPE (``vocab_target`` tokens incl. the 256 bytes) and wrap it as Qwen2Tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer

    raw = Tokenizer(BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(raw.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    first_special = len(vocab)
    for offset, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = first_special + offset
    extra = [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)]
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        extra_special_tokens=extra,
        model_max_length=32768,
        errors="replace",
    )
