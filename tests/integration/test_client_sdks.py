"""The field's clients against a real socket: the official ``openai`` SDK and LangChain's
``OpenAIEmbeddings`` get the errors and shapes they expect (BadRequestError for a malformed
request, token-array embeddings, ``models.retrieve``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from support import MODEL, LiveServer, make_settings
from vlmserve.api.app import build_app
from vlmserve.config import ModelConfig, Settings
from vlmserve.registry.build import hf_handle
from vlmserve.registry.manager import ModelManager
from vlmserve.testing import build_lora_adapter

EMBED = "tiny-vlm2vec"


@pytest.fixture(scope="module")
def server(tiny_dir: Path, chat_models: ModelManager) -> Iterator[LiveServer]:
    cfg = ModelConfig(
        name=EMBED,
        source=str(tiny_dir),
        adapter=str(build_lora_adapter(tiny_dir)),
        roles=["embedding"],
    )
    embedder = hf_handle(cfg, Settings(device="cpu"))
    embedder.backend.load()
    models = ModelManager([*chat_models.handles, embedder])
    with LiveServer(build_app(make_settings(tiny_dir), models=models)) as live:
        yield live
    embedder.backend.close()


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_a_malformed_request_raises_bad_request_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[])
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages"
    assert "function-after" not in error["message"] and "messages" in error["message"]


def test_validator_internals_never_reach_the_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 5}])
    message = caught.value.body["message"]  # type: ignore[index]
    assert message.startswith("messages[0].content"), message
    assert "[" not in message.split(":")[0].replace("[0]", ""), message
    assert "function-after" not in message and "str]" not in message


def test_models_retrieve_returns_the_card_and_404s_unknown_ids(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert [m.id for m in client.models.list().data] == [MODEL, EMBED]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_token_arrays_embed_as_the_text_they_decode_to(
    client: openai.OpenAI, tiny_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer("a dog on a beach")["input_ids"]
    as_text = client.embeddings.create(model=EMBED, input="a dog on a beach")
    as_ids = client.embeddings.create(model=EMBED, input=[ids, [5, 6, 7]])
    assert len(as_ids.data) == 2
    assert np.allclose(as_ids.data[0].embedding, as_text.data[0].embedding, atol=1e-5)
    single = client.embeddings.create(model=EMBED, input=[5, 6, 7])
    assert np.allclose(single.data[0].embedding, as_ids.data[1].embedding, atol=1e-5)


def test_ids_outside_the_vocabulary_are_a_400_that_says_to_send_text(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=EMBED, input=[[15339, 1917]])  # OpenAI-tokenizer ids
    error = caught.value.body
    assert error["code"] == "invalid_token_ids" and error["param"] == "input"  # type: ignore[index]
    assert "check_embedding_ctx_length=False" in error["message"]  # type: ignore[index]


def test_langchain_embeddings_work_with_the_setting_the_error_names(server: LiveServer) -> None:
    embeddings = OpenAIEmbeddings(
        model=EMBED,
        base_url=f"{server.url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    docs = embeddings.embed_documents(["a dog on a beach", "a red car"])
    query = embeddings.embed_query("a dog on a beach")
    assert len(docs) == 2 and len(query) == len(docs[0]) == 128
    assert np.allclose(query, docs[0], atol=1e-5)
