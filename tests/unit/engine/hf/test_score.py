"""HFRerankBackend on tiny jina-reranker-m0 and Qwen3-VL-Reranker checkpoints: every score
equals a direct transformers forward of the pair (the models' own published recipes, written
out here by hand), alone and batched with other pairs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from vlmserve.engine.configs import RerankConfig
from vlmserve.engine.hf.loading import LoadOptions
from vlmserve.engine.hf.score.backend import HFRerankBackend
from vlmserve.engine.models.prefill_only import SHARED_MIN, shared_prefix
from vlmserve.engine.types import EmbedInput, ScorePair
from vlmserve.errors import InvalidRequest
from vlmserve.testing.families.rerankers import build_jina_reranker, build_qwen3_vl_reranker
from vlmserve.testing.media import gradient_image

TOL = 1e-4
QWEN3_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
QWEN3_INSTRUCT = "Given a search query, retrieve relevant candidates that answer the query."


def load(path: Path, **config: Any) -> HFRerankBackend:
    options = LoadOptions(source=str(path), device="cpu", dtype="float32")
    backend = HFRerankBackend("tiny-rerank", options, config=RerankConfig.defaults(**config))
    backend.load()
    return backend


@pytest.fixture(scope="module")
def jina() -> Iterator[HFRerankBackend]:
    backend = load(build_jina_reranker())
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def qwen3() -> Iterator[HFRerankBackend]:
    backend = load(build_qwen3_vl_reranker())
    yield backend
    backend.close()


def _jina_reference(backend: HFRerankBackend, query: str, doc: str | Image.Image) -> float:
    """jina-reranker-m0's ``compute_score`` for one pair, on transformers' Qwen2-VL."""
    from safetensors.torch import load_file

    loaded = backend._require()
    image = doc if isinstance(doc, Image.Image) else None
    doc_part = "<|vision_start|><|image_pad|><|vision_end|>" if image else doc
    text = f"**Document**:\n{doc_part}\n**Query**:\n{query}"
    inputs = loaded.processor(text=[text], images=[image] if image else None, return_tensors="pt")
    for key, value in (("input_ids", 100), ("attention_mask", 1), ("mm_token_type_ids", 0)):
        if key in inputs:  # the score token: text, attended
            extra = torch.full((1, 1), value, dtype=inputs[key].dtype)
            inputs[key] = torch.cat([inputs[key], extra], dim=1)
    weights = load_file(str(Path(backend.options.source) / "model.safetensors"))
    with torch.no_grad():
        out = loaded.model(**inputs, output_hidden_states=True)
        last = out.hidden_states[-1][:, -1]
        hidden = torch.relu(last @ weights["score.0.weight"].T + weights["score.0.bias"])
        logit = hidden @ weights["score.2.weight"].T + weights["score.2.bias"]
    return float(torch.sigmoid(logit - 2.65))


def _side(prefix: str, text: str | None, image: Any, video: Any) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": prefix}]
    parts += [{"type": "video"}] if video is not None else []
    parts += [{"type": "image"}] if image is not None else []
    return parts + ([{"type": "text", "text": text}] if text else [])


def _qwen3_reference(backend: HFRerankBackend, query: str, doc: EmbedInput) -> float:
    """Qwen3-VL-Reranker's ``format_mm_instruction`` + P(yes) over {no, yes} at the end."""
    loaded = backend._require()
    user = [
        {"type": "text", "text": f"<Instruct>: {QWEN3_INSTRUCT}"},
        *_side("<Query>:", query, None, None),
        *_side("\n<Document>:", doc.text, doc.image, doc.frames),
    ]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": QWEN3_SYSTEM}]},
        {"role": "user", "content": user},
    ]
    text = loaded.processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if doc.image is not None:
        kwargs["images"] = [doc.image]
    if doc.frames is not None:
        kwargs["videos"] = [doc.frames]
        kwargs["do_sample_frames"] = False
    inputs = loaded.processor(**kwargs)
    vocab = loaded.processor.tokenizer.get_vocab()
    with torch.no_grad():
        logits = loaded.model(**inputs).logits[:, -1, [vocab["no"], vocab["yes"]]]
    return float(torch.softmax(logits.float(), dim=-1)[0, 1])


def frames(n: int, seed: int) -> list[Image.Image]:
    return [gradient_image(64, 64, seed=seed * 10 + i) for i in range(n)]


QUERY = "where is the pet"
TEXTS = ["a cat sits on the mat", "blue", "the sun is red and the car is fast today"]


def test_jina_scores_equal_its_compute_score_alone_and_batched(jina: HFRerankBackend) -> None:
    image = gradient_image(64, 64, seed=3)
    docs: list[str | Image.Image] = [*TEXTS, image]
    expected = [_jina_reference(jina, QUERY, d) for d in docs]
    pairs = [
        ScorePair(EmbedInput(QUERY), EmbedInput(d) if isinstance(d, str) else EmbedInput(image=d))
        for d in docs
    ]
    batched = jina.score_sync(pairs).scores
    alone = [jina.score_sync([p]).scores[0] for p in pairs]
    assert batched == pytest.approx(expected, abs=TOL)
    assert alone == pytest.approx(expected, abs=TOL)
    assert len(set(round(s, 6) for s in expected)) == len(expected)  # the pairs differ


def test_qwen3_scores_equal_p_yes_for_text_image_and_video_mixed(qwen3: HFRerankBackend) -> None:
    docs = [
        EmbedInput(TEXTS[0]),
        EmbedInput(image=gradient_image(64, 64, seed=5)),
        EmbedInput(frames=frames(4, seed=1)),
        EmbedInput(TEXTS[2], image=gradient_image(96, 64, seed=6)),
        EmbedInput(TEXTS[1]),
    ]
    expected = [_qwen3_reference(qwen3, QUERY, d) for d in docs]
    pairs = [ScorePair(EmbedInput(QUERY), d) for d in docs]
    scored = qwen3.score_sync(pairs)
    assert scored.scores == pytest.approx(expected, abs=TOL)
    assert [qwen3.score_sync([p]).scores[0] for p in pairs] == pytest.approx(expected, abs=TOL)
    with torch.inference_mode():  # the batch ran the query's part once (DeepStack after it)
        rows = qwen3._rows(qwen3._loaded, qwen3._head, pairs)
    assert any(row.deepstack is not None for row in rows)
    assert shared_prefix(qwen3._runner, rows) >= SHARED_MIN
    assert scored.prompt_tokens > 0
    assert qwen3.capabilities() == frozenset({"vision", "video"})


def test_batches_are_capped_at_max_batch(qwen3: HFRerankBackend) -> None:
    pairs = [ScorePair(EmbedInput(QUERY), EmbedInput(t)) for t in TEXTS * 3]
    before, qwen3.max_batch = qwen3.max_batch, 4
    try:
        start = qwen3.forward_passes
        scores = qwen3.score_sync(pairs).scores
        assert qwen3.forward_passes - start == 3  # 9 pairs in passes of 4, 4, 1
    finally:
        qwen3.max_batch = before
    assert scores[:3] == pytest.approx(scores[3:6], abs=TOL)


def test_max_doc_tokens_cuts_the_document_text(jina: HFRerankBackend) -> None:
    tokenizer = jina._require().processor.tokenizer
    long = TEXTS[2]
    ids = tokenizer(long, add_special_tokens=False)["input_ids"]
    cut = tokenizer.decode(ids[:3])
    pair = ScorePair(EmbedInput(QUERY), EmbedInput(long), max_doc_tokens=3)
    assert jina.score_sync([pair]).scores[0] == pytest.approx(
        _jina_reference(jina, QUERY, cut), abs=TOL
    )


def test_a_pair_over_the_context_is_a_400_naming_the_document() -> None:
    backend = load(build_jina_reranker(), max_model_len=40)
    try:
        pairs = [ScorePair(EmbedInput(QUERY), EmbedInput(t)) for t in ("ok", "word " * 60)]
        with pytest.raises(InvalidRequest, match=r"documents\[1\].*max_tokens_per_doc"):
            backend.score_sync(pairs)
    finally:
        backend.close()


def test_scripted_rerankers_rank_by_the_scripted_word() -> None:
    docs = ["a cat sits", "a dog and a dog", "the sun", "a dog runs far away"]
    for build in (build_jina_reranker, build_qwen3_vl_reranker):
        backend = load(build(scripted=True))
        try:
            pairs = [ScorePair(EmbedInput(QUERY), EmbedInput(d)) for d in docs]
            scores = backend.score_sync(pairs).scores
        finally:
            backend.close()
        assert scores[1] > scores[3] > scores[0]
        assert scores[0] == pytest.approx(scores[2], abs=1e-6)  # no dog: no signal


def test_empty_sides_are_refused(jina: HFRerankBackend) -> None:
    with pytest.raises(InvalidRequest, match=r"documents\[0\] is empty"):
        jina.score_sync([ScorePair(EmbedInput(QUERY), EmbedInput("  "))])
    with pytest.raises(InvalidRequest, match="at least one document"):
        jina.score_sync([])


def test_an_embedding_model_scores_by_cosine_of_direct_forwards(tiny_dir: Path) -> None:
    """Cosine of two transformers forwards (VLM2Vec prompts, last token, normalised)."""
    import asyncio

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmserve.engine.hf.embed import HFEmbedBackend

    options = LoadOptions(source=str(tiny_dir), device="cpu", dtype="float32")
    embedder = HFEmbedBackend("tiny-embed", options)
    embedder.load()
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tiny_dir)

    def vector(content: list[dict[str, Any]], **media: Any) -> torch.Tensor:
        messages = [{"role": "user", "content": content}]
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[prompt], return_tensors="pt", **media)
        with torch.no_grad():
            hidden = model(**inputs, output_hidden_states=True).hidden_states[-1]
        return torch.nn.functional.normalize(hidden[0, -1], dim=-1)

    prefix = "Represent the given query for retrieving relevant video clips: "
    image = gradient_image(64, 64, seed=7)
    query = vector([{"type": "text", "text": prefix + QUERY}])
    expected = [
        float(query @ vector([{"type": "text", "text": prefix + TEXTS[0]}])),
        float(
            query
            @ vector(
                [{"type": "image"}, {"type": "text", "text": "Represent the given image."}],
                images=[image],
            )
        ),
    ]
    pairs = [
        ScorePair(EmbedInput(QUERY), EmbedInput(TEXTS[0])),
        ScorePair(EmbedInput(QUERY), EmbedInput(image=image)),
    ]
    try:
        scored = asyncio.run(embedder.score(pairs))
    finally:
        embedder.close()
    assert scored.scores == pytest.approx(expected, abs=TOL)


def test_pairs_run_as_packed_prefill_only_rows_without_a_kv_cache(
    qwen3: HFRerankBackend,
) -> None:
    assert qwen3.packed  # Qwen3-VL: the batched engine's own model code
    qwen3.score_sync([ScorePair(EmbedInput(QUERY), EmbedInput(t)) for t in TEXTS])
    assert qwen3._runner.cache is None  # never allocated: no KV kept after the step


def test_a_document_image_seen_again_is_not_encoded_again(jina: HFRerankBackend) -> None:
    """The vision tower runs once per distinct image: a repeated document image, in the same
    request or a later one, comes from the vision cache, and scores the same."""
    model = jina._require().model.model
    tower = model.get_image_features
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return tower(*args, **kwargs)

    image, other = gradient_image(64, 64, seed=11), gradient_image(64, 64, seed=12)
    pairs = [ScorePair(EmbedInput(QUERY), EmbedInput(image=i)) for i in (image, other, image)]
    model.get_image_features = counted
    try:
        first = jina.score_sync(pairs).scores
        assert len(calls) == 2  # two distinct images
        again = jina.score_sync([pairs[0]]).scores
        assert len(calls) == 2  # seen before: not encoded again
    finally:
        del model.get_image_features  # the class's method again
    assert first[0] == pytest.approx(first[2], abs=1e-6)
    assert again[0] == pytest.approx(first[0], abs=1e-6)
    assert first[0] == pytest.approx(_jina_reference(jina, QUERY, image), abs=TOL)


def test_a_forward_packs_at_most_the_token_budget(jina: HFRerankBackend) -> None:
    pairs = [ScorePair(EmbedInput(QUERY), EmbedInput(t)) for t in TEXTS * 2]
    expected = jina.score_sync(pairs).scores
    longest = max(len(row["input_ids"][0]) for row in _rows(jina, pairs))
    before = jina.max_batched_tokens
    jina.max_batched_tokens = longest  # room for one pair a forward
    try:
        start = jina.forward_passes
        scores = jina.score_sync(pairs).scores
        assert jina.forward_passes - start == len(pairs)
    finally:
        jina.max_batched_tokens = before
    assert scores == pytest.approx(expected, abs=TOL)


def _rows(backend: HFRerankBackend, pairs: list[ScorePair]) -> list[dict[str, Any]]:
    from vlmserve.engine.hf.score.prompts import pair_inputs

    return pair_inputs(backend._require().processor, backend.kind, pairs)
