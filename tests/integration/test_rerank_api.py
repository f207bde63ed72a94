"""``/v1/rerank`` and ``/v1/score`` in process: a scripted Qwen3-VL reranker, a jina-reranker-m0
layout model and an embedding model beside the chat model; text, image and video documents."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from support import MODEL, make_settings
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.engine.types import EmbedInput, ScorePair
from vlmserve.registry.build import hf_handle
from vlmserve.registry.manager import ModelHandle, ModelManager
from vlmserve.testing.families.rerankers import build_jina_reranker, build_qwen3_vl_reranker
from vlmserve.testing.media import data_url, image_bytes, mp4_bytes

QWEN3 = "tiny-qwen3-rerank"  # scripted: relevance = share of " dog" tokens
JINA = "tiny-jina-rerank"
EMBED = "tiny-embed"
QUERY = "where is the pet"
DOCS = ["a cat sits", "a dog and a dog", "the sun", "a dog runs far away"]
TOL = 1e-4


def _handle(name: str, source: Path, role: str) -> ModelHandle:
    cfg = ModelConfig(name=name, source=str(source), roles=[role])
    return hf_handle(cfg, Settings(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def models(tiny_dir: Path, chat_models: ModelManager) -> Iterator[ModelManager]:
    extra = [
        _handle(QWEN3, build_qwen3_vl_reranker(scripted=True), "rerank"),
        _handle(JINA, build_jina_reranker(), "rerank"),
        _handle(EMBED, tiny_dir, "embedding"),
    ]
    for handle in extra:
        handle.backend.load()
    yield ModelManager([*chat_models.handles, *extra])
    for handle in extra:
        handle.backend.close()


@pytest.fixture
async def client(
    tiny_dir: Path, models: ModelManager, tmp_path: Path
) -> AsyncIterator[httpx.AsyncClient]:
    settings = make_settings(tiny_dir, rerank_max_documents=6, files_dir=str(tmp_path))
    app = build_app(settings, models=models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r", timeout=120) as c:
            yield c


async def rerank(client: httpx.AsyncClient, path: str = "/v1/rerank", **body: Any) -> Any:
    r = await client.post(path, json={"query": QUERY, "documents": DOCS, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_scripted_reranker_orders_documents_as_scripted(
    client: httpx.AsyncClient,
) -> None:
    body = await rerank(client, model=QWEN3)
    assert [r["index"] for r in body["results"]][:2] == [1, 3]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert body["results"][0]["document"] == {"text": DOCS[1]}
    assert body["model"] == QWEN3 and body["id"].startswith("rerank-")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0


async def test_top_n_and_return_documents(client: httpx.AsyncClient) -> None:
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        body = await rerank(client, path, model=QWEN3, top_n=2, return_documents=False)
        assert [r["index"] for r in body["results"]] == [1, 3]
        assert all("document" not in r for r in body["results"])


async def test_jina_scores_match_the_backend_and_refuse_video(
    client: httpx.AsyncClient, models: ModelManager
) -> None:
    body = await rerank(client, model=JINA)
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    backend: Any = models.resolve(JINA).backend
    direct = backend.score_sync([ScorePair(EmbedInput(QUERY), EmbedInput(d)) for d in DOCS])
    assert [got[i] for i in range(len(DOCS))] == pytest.approx(direct.scores, abs=TOL)
    video = {"video": data_url(mp4_bytes(4), "video/mp4")}
    r = await client.post(
        "/v1/rerank", json={"model": JINA, "query": QUERY, "documents": ["a", video]}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "model_capability_missing"
    assert "video" in r.json()["error"]["message"]


async def test_text_image_and_video_documents_mixed(client: httpx.AsyncClient) -> None:
    image = data_url(image_bytes(64, 64), "image/png")
    video = data_url(mp4_bytes(4), "video/mp4")
    docs = ["a dog and a dog", {"image": image}, {"video": video, "text": "a clip"}]
    r = await client.post("/v1/rerank", json={"model": QWEN3, "query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    results = {x["index"]: x for x in r.json()["results"]}
    assert sorted(results) == [0, 1, 2]
    assert results[1]["document"] == {"image": image}
    alone = await rerank(client, model=QWEN3)  # the text document scored in other company
    same = next(x for x in alone["results"] if x["index"] == 1)["relevance_score"]
    assert results[0]["relevance_score"] == pytest.approx(same, abs=TOL)
    vllm_form = {"content": [{"type": "image_url", "image_url": {"url": image}}]}
    r = await client.post(
        "/v1/rerank", json={"model": QWEN3, "query": QUERY, "documents": vllm_form}
    )
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["relevance_score"] == pytest.approx(
        results[1]["relevance_score"], abs=TOL
    )


@pytest.mark.parametrize(
    ("documents", "needle"),
    [([], "documents is empty"), (["d"] * 7, "the limit is 6 (VLMSERVE_RERANK_MAX_DOCUMENTS)")],
)
async def test_empty_and_too_many_documents_are_400s(
    client: httpx.AsyncClient, documents: list[str], needle: str
) -> None:
    r = await client.post(
        "/v1/rerank", json={"model": QWEN3, "query": QUERY, "documents": documents}
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "documents"


async def test_a_chat_model_does_not_score(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a"]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "wrong_model_kind"
    chat = {"model": QWEN3, "messages": [{"role": "user", "content": "hi"}]}
    r = await client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "is a reranker" in r.json()["error"]["message"]


async def test_an_embedding_model_scores_by_cosine(client: httpx.AsyncClient) -> None:
    body = await rerank(client, model=EMBED)
    r = await client.post("/v1/embeddings", json={"model": EMBED, "input": [QUERY, *DOCS]})
    vectors = np.asarray([d["embedding"] for d in r.json()["data"]])
    cosine = vectors[1:] @ vectors[0]
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    assert [got[i] for i in range(len(DOCS))] == pytest.approx(cosine.tolist(), abs=TOL)


async def test_score_one_to_many_pairwise_and_multimodal(client: httpx.AsyncClient) -> None:
    ranked = await rerank(client, model=QWEN3)
    by_index = {x["index"]: x["relevance_score"] for x in ranked["results"]}
    r = await client.post("/v1/score", json={"model": QWEN3, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "score"
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [by_index[i] for i in range(len(DOCS))], abs=TOL
    )
    pairwise = {"model": QWEN3, "text_1": [QUERY, QUERY], "text_2": DOCS[:2]}
    r = await client.post("/score", json=pairwise)
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(
        [by_index[0], by_index[1]], abs=TOL
    )
    image = data_url(image_bytes(64, 64), "image/png")
    data = {"content": [{"type": "image_url", "image_url": {"url": image}}]}
    r = await client.post("/v1/score", json={"model": QWEN3, "data_1": QUERY, "data_2": data})
    assert r.status_code == 200, r.text and len(r.json()["data"]) == 1
    r = await client.post("/v1/score", json={"model": QWEN3, "text_1": DOCS[:2], "text_2": DOCS})
    assert r.status_code == 400 and "pairwise" in r.json()["error"]["message"]


async def test_an_uploaded_image_is_a_document_by_file_id(client: httpx.AsyncClient) -> None:
    png = image_bytes(64, 64, seed=4)
    up = await client.post(
        "/v1/files", files={"file": ("p.png", png, "image/png")}, data={"purpose": "vision"}
    )
    assert up.status_code == 200, up.text
    by_file = {"file_id": up.json()["id"]}
    by_url = {"image": data_url(png, "image/png")}
    r = await client.post(
        "/v1/rerank", json={"model": QWEN3, "query": QUERY, "documents": [by_file, by_url]}
    )
    assert r.status_code == 200, r.text
    scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert scores[0] == pytest.approx(scores[1], abs=TOL)
    missing = {"model": QWEN3, "query": QUERY, "documents": [{"file_id": "file-nope"}]}
    r = await client.post("/v1/rerank", json=missing)
    assert r.status_code == 404


async def test_models_say_which_score(client: httpx.AsyncClient) -> None:
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert cards[QWEN3]["scores"] and cards[JINA]["scores"] and cards[EMBED]["scores"]
    assert not cards[MODEL]["scores"]
    assert "rerank" in cards[QWEN3]["roles"]


async def test_long_documents_are_cut_by_max_tokens_per_doc_else_refused(
    client: httpx.AsyncClient, models: ModelManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models.resolve(JINA).backend, "max_model_len", 48)
    docs = ["short", "dog " * 80]
    body = {"model": JINA, "query": QUERY, "documents": docs}
    r = await client.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "documents[1]" and "max_tokens_per_doc" in error["message"]
    r = await client.post("/v1/rerank", json={**body, "max_tokens_per_doc": 8})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 2


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        (
            "/v1/rerank",
            {"query": QUERY, "documents": [{"image": "x", "video": "y"}]},
            "at most one",
        ),
        ("/v1/rerank", {"query": QUERY, "documents": [{"title": "no text"}]}, "needs text"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/score", {"text_1": QUERY}, "both sides"),
        ("/v1/score", {"text_1": QUERY, "data_2": ["a"]}, "text_1 and text_2"),
    ],
)
async def test_malformed_requests_are_400s(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], needle: str
) -> None:
    r = await client.post(path, json={"model": QWEN3, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


async def test_a_gateway_relays_rerank_and_score_to_its_upstream(
    tiny_dir: Path, models: ModelManager
) -> None:
    from upstreams import serve_asgi
    from vlmserve.gateway.upstream import UpstreamBackend, UpstreamConfig

    worker = build_app(make_settings(tiny_dir), models=models)
    async with serve_asgi(worker) as url:
        config = UpstreamConfig(model=QWEN3, base_urls=[url], health_interval=0, rerank=True)
        gateway_models = ModelManager(
            [ModelHandle("gw-rerank", ["rerank"], UpstreamBackend("gw-rerank", config))]
        )
        app = build_app(Settings(device="cpu"), models=gateway_models)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gw", timeout=120
            ) as gw:
                via = await rerank(gw, top_n=2)
                r = await gw.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS[:2]})
        await gateway_models.aclose()
    assert via["model"] == "gw-rerank"
    assert [x["index"] for x in via["results"]] == [1, 3]
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 2


async def test_without_a_model_the_rerank_role_scores_else_a_404_says_what_to_add(
    tiny_dir: Path, client: httpx.AsyncClient, chat_models: ModelManager
) -> None:
    body = await rerank(client)  # no "model": the rerank role's first model
    assert body["model"] == QWEN3
    app = build_app(make_settings(tiny_dir), models=chat_models)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as only_chat:
            r = await only_chat.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 404
    assert 'roles = ["rerank"]' in r.json()["error"]["message"]


async def test_a_document_part_with_an_empty_url_is_a_400(client: Any) -> None:
    """Found by the contract fuzzer: a content part that makes no item was a 500."""
    body = {
        "query": "a dog",
        "documents": {"content": [{"type": "image_url", "image_url": {"url": ""}}]},
    }
    r = await client.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "documents"
