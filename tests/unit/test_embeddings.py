"""The embeddings request model, response building (float, base64, dimensions), pooling and its
config, and the packaged model's short name."""
from __future__ import annotations

import base64
import json
import zipfile

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from pagedserve.replicas.model_files import embedding_model
from pagedserve.replicas.core.pooling import PoolingConfig
from pagedserve.replicas.execution.pooler import pool
from pagedserve.serve_app.embeddings import EmbeddingRequest, build_response


@pytest.mark.parametrize("value", [
    [], "", ["a", ""], [[]], 5, [1, "a"], [True, 2], [1.0, 2.0], {"text": "a"}, [["a"]],
    ["x"] * 2049,
])
def test_bad_inputs_are_rejected(value):
    with pytest.raises(ValidationError):
        EmbeddingRequest(input=value)


def test_inputs_and_fields():
    assert EmbeddingRequest(input="a").items() == ["a"]
    assert EmbeddingRequest(input=["a", "b"]).items() == ["a", "b"]
    assert EmbeddingRequest(input=[1, 2]).items() == [[1, 2]]
    assert EmbeddingRequest(input=[[1], [2, 3]]).items() == [[1], [2, 3]]
    EmbeddingRequest(input="a", user="someone", encoding_format="base64", dimensions=8)
    for bad in ({"encoding_format": "hex"}, {"dimensions": 0}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            EmbeddingRequest(input="a", **bad)


def test_response_float_base64_and_dimensions():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3, 16)).astype(np.float32)
    token_ids = [[1, 2], [3], [4, 5, 6]]
    floats = build_response(EmbeddingRequest(input=["a", "b", "c"]), vectors, token_ids, "m")
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == 6
    np.testing.assert_array_equal(np.array([d.embedding for d in floats.data], np.float32), vectors)
    encoded = build_response(EmbeddingRequest(input=["a", "b", "c"], encoding_format="base64"),
                             vectors, token_ids, "m")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                        for d in encoded.data])
    np.testing.assert_array_equal(decoded, vectors)
    short = build_response(EmbeddingRequest(input=["a", "b", "c"], dimensions=4), vectors,
                           token_ids, "m")
    got = np.array([d.embedding for d in short.data])
    expected = vectors[:, :4] / np.linalg.norm(vectors[:, :4], axis=1, keepdims=True)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    body = json.loads(short.model_dump_json())
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"


def test_pooling_config_from_sentence_transformers_modules(tmp_path):
    assert PoolingConfig.from_model_dir(tmp_path) == PoolingConfig("mean", True)  # plain HF dir
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    modules = [{"type": "sentence_transformers.models.Transformer", "path": ""},
               {"type": "sentence_transformers.models.Pooling", "path": "pool"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert PoolingConfig.from_model_dir(tmp_path) == PoolingConfig("cls", False)
    modules.append({"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert PoolingConfig.from_model_dir(tmp_path) == PoolingConfig("cls", True)


@pytest.mark.parametrize("mode", ["cls", "last", "mean", "max", "mean_sqrt_len"])
def test_pool_packed_rows_equals_per_sequence(mode):
    torch.manual_seed(0)
    lengths = [3, 1, 5]
    hidden = torch.randn(sum(lengths), 4)
    starts = [0, 3, 4, 9]
    rows = [hidden[s:e] for s, e in zip(starts[:-1], starts[1:])]
    expected = torch.stack([{"cls": r[0], "last": r[-1], "mean": r.mean(0), "max": r.amax(0),
                             "mean_sqrt_len": r.sum(0) / len(r) ** 0.5}[mode] for r in rows])
    torch.testing.assert_close(pool(hidden, starts, PoolingConfig(mode, False)), expected)
    normalized = pool(hidden, starts, PoolingConfig(mode, True))
    torch.testing.assert_close(normalized, torch.nn.functional.normalize(expected, dim=1))


def test_short_name_unpacks_the_packaged_zip_once(tmp_path, monkeypatch):
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("config.json", json.dumps({"architectures": ["BertModel"]}))
        z.writestr("modules.json", "[]")
    monkeypatch.setattr(embedding_model, "find_embedding_zip", lambda: archive)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = embedding_model.resolve_model_name(embedding_model.EMBEDDING_MODEL_NAME)
    assert path == str(tmp_path / "cache" / embedding_model.EMBEDDING_MODEL_NAME)
    assert embedding_model.uses_encoder(embedding_model.EMBEDDING_MODEL_NAME)
    archive.unlink()  # a second resolve finds the unpacked copy
    assert embedding_model.resolve_model_name(embedding_model.EMBEDDING_MODEL_NAME) == path
    assert embedding_model.resolve_model_name("/some/dir") == "/some/dir"
    assert not embedding_model.uses_encoder(None)
