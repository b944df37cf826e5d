"""Checkpoint directory -> model: shards, dtypes, architectures, and clear errors."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers

from pagedserve.kernels.metadata import kv_cache_bytes_per_block, kv_cache_shape
from pagedserve.kernels.cpu_features import has_native_bf16
from pagedserve.replicas.models.loader import (
    DTYPES, iterate_weights, load_model, resolve_dtype, weight_files,
)
from pagedserve.replicas.models import LlamaForCausalLM

NATIVE_AUTO = torch.bfloat16 if has_native_bf16() else torch.float32  # dtype="auto" on this CPU


def test_sharded_checkpoint_loads_identically(tiny_model_dir, tmp_path):
    path = tiny_model_dir("qwen2")
    sharded = tmp_path / "sharded"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    files = weight_files(sharded)
    assert len(files) > 3 and not (sharded / "model.safetensors").exists()
    whole, _, _ = load_model(path, attention_backend="reference")
    split, _, _ = load_model(sharded, attention_backend="reference")
    whole_state, split_state = whole.state_dict(), split.state_dict()
    assert whole_state.keys() == split_state.keys()
    for name, tensor in whole_state.items():
        assert torch.equal(tensor, split_state[name]), name


def test_iterate_weights_streams_every_tensor_once(tiny_model_dir):
    path = tiny_model_dir("llama")
    names = [name for name, _ in iterate_weights(weight_files(path), progress=False)]
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert sorted(names) == sorted(f.keys())


@pytest.mark.parametrize("name, dtype, expected", [
    # auto on CPU: bf16 where the CPU computes it natively, whatever the checkpoint's dtype, else
    # fp32 (AVX2-only: fp32 is ~60x faster than emulated bf16)
    ("llama", "auto", NATIVE_AUTO),
    ("llama_bf16", "auto", NATIVE_AUTO),
    ("llama_bf16", "bfloat16", torch.bfloat16),
    ("llama_bf16", "float32", torch.float32),
    ("llama", "float16", torch.float16),
    ("llama", torch.bfloat16, torch.bfloat16),
])
def test_dtype(tiny_model_dir, name, dtype, expected):
    model, hf_config, torch_dtype = load_model(tiny_model_dir(name), dtype=dtype,
                                               attention_backend="reference")
    assert torch_dtype == expected
    assert {p.dtype for p in model.parameters()} == {expected}
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert hf_config.num_hidden_layers == model.num_layers == 2


def test_auto_dtype_without_dtype_field_follows_the_cpu(tiny_model_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama_bf16"), path)
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(config))
    _, _, torch_dtype = load_model(path, attention_backend="reference")
    assert torch_dtype == NATIVE_AUTO


def test_a_quantized_checkpoint_runs_its_activations_in_the_auto_dtype(tmp_path):
    """Weight-only quantized: the weights stay packed; the activations (and the dense layers) take
    auto's dtype, bf16 on AVX512-BF16, where csrc/gemm_q.c multiplies bf16 rows natively."""
    from tests.quant_checkpoints import build_quant_model, write_gptq
    write_gptq(build_quant_model(tmp_path / "dense"), tmp_path / "gptq")
    model, _, torch_dtype = load_model(tmp_path / "gptq", dtype="auto", attention_backend="reference")
    assert torch_dtype == NATIVE_AUTO
    assert model.lm_head.weight.dtype == NATIVE_AUTO

@pytest.mark.parametrize("found", ["float32", "bfloat16", "float16", None])
def test_auto_dtype_rule(found):
    config = SimpleNamespace(dtype=found)
    assert resolve_dtype("auto", config) == NATIVE_AUTO
    assert resolve_dtype("auto", config, "cuda") == DTYPES.get(found, torch.float32)
    assert resolve_dtype("float32", config) == torch.float32


@pytest.mark.parametrize("level, expected", [("avx512_bf16", torch.bfloat16), ("avx512", torch.float32),
                                             ("avx2", torch.float32)])
def test_auto_dtype_per_level_whatever_the_checkpoint(monkeypatch, level, expected):
    from pagedserve.kernels import cpu_features
    monkeypatch.setattr(cpu_features, "cpu_level", lambda: level)  # any host: the table's rule
    for found in ("float32", "bfloat16", "float16"):
        assert resolve_dtype("auto", SimpleNamespace(dtype=found)) == expected


def test_unsupported_dtype_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        load_model(tiny_model_dir("llama"), dtype="float64")


def test_unsupported_architecture_is_a_clear_error(tiny_model_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['LlamaForSequenceClass"
                                         r"ification'\]: supported are \['LlamaForCausalLM'"):
        load_model(path)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a local model"):
        load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="is not a local model"):
        load_model(tmp_path)  # exists, but has no config.json


def test_missing_weights_file(tiny_model_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_model(path)


def test_kv_cache_helpers(tiny_model_dir):
    path = tiny_model_dir("llama_head_dim")
    model, hf_config, _ = load_model(path, attention_backend="reference")
    assert model.kv_cache_shape(10, 16) == kv_cache_shape(10, 16, 2, 32) == (2, 10, 16, 2, 32)
    # 2 layers * (K and V) * 16 slots * 2 heads * 32 dims * 2 bytes
    assert kv_cache_bytes_per_block(16, 2, 32, hf_config.num_hidden_layers, torch.bfloat16) \
        == 2 * 2 * 16 * 2 * 32 * 2
