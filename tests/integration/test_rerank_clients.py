"""Rerank clients against a real socket: the official ``cohere`` SDK (v1 and v2 rerank),
LangChain's ``CohereRerank`` and a plain Jina-shaped request parse our answers. Each SDK test
is skipped, with the reason, where its package is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import LiveServer, make_settings
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.registry.build import hf_handle
from vlmserve.registry.manager import ModelManager
from vlmserve.testing.families.rerankers import build_qwen3_vl_reranker
from vlmserve.testing.media import data_url, image_bytes

RERANK = "tiny-rerank"  # scripted: relevance = share of " dog" tokens
QUERY = "where is the pet"
DOCS = ["a cat sits", "a dog and a dog", "the sun", "a dog runs far away"]


@pytest.fixture(scope="module")
def server(tiny_dir: Path, chat_models: ModelManager) -> Iterator[LiveServer]:
    cfg = ModelConfig(
        name=RERANK, source=str(build_qwen3_vl_reranker(scripted=True)), roles=["rerank"]
    )
    reranker = hf_handle(cfg, Settings(device="cpu", dtype="float32"))
    reranker.backend.load()
    models = ModelManager([*chat_models.handles, reranker])
    with LiveServer(build_app(make_settings(tiny_dir), models=models)) as live:
        yield live
    reranker.backend.close()


def test_cohere_v2_rerank(server: LiveServer) -> None:
    cohere = pytest.importorskip("cohere", reason="the cohere SDK is not installed")
    client = cohere.ClientV2(api_key="unused", base_url=server.url)
    answer = client.rerank(model=RERANK, query=QUERY, documents=DOCS, top_n=2)
    assert [r.index for r in answer.results] == [1, 3]
    assert answer.results[0].relevance_score > answer.results[1].relevance_score


def test_cohere_v1_rerank_with_documents(server: LiveServer) -> None:
    cohere = pytest.importorskip("cohere", reason="the cohere SDK is not installed")
    client = cohere.Client(api_key="unused", base_url=server.url)
    answer = client.rerank(model=RERANK, query=QUERY, documents=DOCS, return_documents=True)
    assert [r.index for r in answer.results][:2] == [1, 3]
    assert answer.results[0].document is not None
    assert answer.results[0].document.text == DOCS[1]


def test_langchain_cohere_rerank_compresses_documents(server: LiveServer) -> None:
    pytest.importorskip("langchain_cohere", reason="langchain-cohere is not installed")
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    reranker = CohereRerank(model=RERANK, base_url=server.url, cohere_api_key="unused", top_n=2)
    kept = reranker.compress_documents([Document(page_content=d) for d in DOCS], QUERY)
    assert [d.page_content for d in kept] == [DOCS[1], DOCS[3]]
    assert kept[0].metadata["relevance_score"] > kept[1].metadata["relevance_score"]


def test_a_jina_shaped_request_with_an_image_document(server: LiveServer) -> None:
    image = data_url(image_bytes(64, 64), "image/png")
    body = {
        "model": RERANK,
        "query": QUERY,
        "documents": [{"text": DOCS[1]}, {"image": image}, {"text": DOCS[0]}],
        "top_n": 3,
        "return_documents": True,
    }
    answer = httpx.post(f"{server.url}/v1/rerank", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    payload = answer.json()
    order = [r["index"] for r in payload["results"]]
    assert order.index(0) < order.index(2)  # the scripted word outranks no word
    first = next(r for r in payload["results"] if r["index"] == 0)
    assert first["document"] == {"text": DOCS[1]}
    assert set(first) == {"index", "relevance_score", "document"}
    assert {r["index"] for r in payload["results"]} == {0, 1, 2}
    assert payload["usage"]["total_tokens"] > 0
