"""Quantized safetensors checkpoint readers (replicas/quant: GPTQ, AWQ, compressed-tensors): what
they yield means what the format means, and what they cannot read is named.

Each variant is written from a tiny random model in the format's real layout (tests/
quant_checkpoints.py; compressed-tensors' own compressor packs its checkpoints), and the reader's
QuantWeights, through pagedserve.kernels.reference.dequantize_weight, must equal the written weights' float
values (for compressed-tensors, its own decompressor's output).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve.replicas.models.loader import iterate_weights, weight_files
from pagedserve.replicas.quant import quantization_of, quantized_tensors
from tests import quant_checkpoints as qc
from tests.quant_checkpoints import assert_same_weights as assert_same


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return qc.build_quant_model(tmp_path_factory.mktemp("quant") / "hf")


def safetensors_read(out: Path) -> dict:
    config = json.loads((out / "config.json").read_text())
    method = quantization_of(out)
    return dict(quantized_tensors(method, config, iterate_weights(weight_files(out), progress=False)))


@pytest.mark.parametrize("bits,group_size,sym,desc_act,checkpoint_format", [
    (4, 32, True, False, "gptq"), (4, 32, False, False, "gptq"), (4, 64, True, True, "gptq"),
    (4, 128, False, True, "gptq"), (4, -1, True, False, "gptq"), (8, 128, True, False, "gptq"),
    (8, 32, False, True, "gptq"), (4, 32, False, False, "gptq_v2")])
def test_gptq(tiny, tmp_path, bits, group_size, sym, desc_act, checkpoint_format):
    reference = qc.write_gptq(tiny, tmp_path / "gptq", bits=bits, group_size=group_size, sym=sym,
                              desc_act=desc_act, checkpoint_format=checkpoint_format)
    got = safetensors_read(tmp_path / "gptq")
    assert_same(got, reference, rtol=0)
    weight = got["model.layers.0.self_attn.q_proj.weight"]
    assert weight.bits == bits and weight.group_size == (256 if group_size == -1 else group_size)
    assert (weight.perm is not None) == desc_act


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq(tiny, tmp_path, group_size):
    reference = qc.write_awq(tiny, tmp_path / "awq", group_size=group_size)
    assert quantization_of(tmp_path / "awq") == "awq"
    assert_same(safetensors_read(tmp_path / "awq"), reference, rtol=0)


@pytest.mark.parametrize("bits,strategy,group_size,symmetric,format", [
    (4, "group", 32, True, "pack-quantized"), (4, "group", 128, False, "pack-quantized"),
    (8, "channel", None, True, "pack-quantized"), (8, "group", 64, False, "pack-quantized"),
    (4, "channel", None, False, "pack-quantized"), (4, "tensor", None, True, "pack-quantized"),
    (8, "channel", None, True, "naive-quantized")])
def test_compressed_tensors_matches_its_decompressor(tiny, tmp_path, bits, strategy, group_size,
                                                     symmetric, format):
    reference = qc.write_compressed_tensors(tiny, tmp_path / "ct", bits=bits, strategy=strategy,
                                            group_size=group_size, symmetric=symmetric, format=format)
    assert quantization_of(tmp_path / "ct") == "compressed-tensors"
    assert_same(safetensors_read(tmp_path / "ct"), reference)


# -- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("config,message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ with 3 bits.*supported bits are 4, 8"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'.*gemm"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "input activations quantization"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     "format 'float-quantized'.*weight type 'float'"),
])
def test_unsupported_schemes_are_named(config, message):
    method = quantization_of({"quantization_config": config})
    with pytest.raises(ValueError, match=message):
        quantized_tensors(method, {"quantization_config": config}, iter([]))


def test_quantization_of():
    assert quantization_of("/models/x.Q4_K_M.gguf") == "gguf"
    assert quantization_of({"model_type": "llama"}) is None
    assert quantization_of({"quantization_config": {"quant_method": "compressed_tensors"}}) == "compressed-tensors"
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported: supported are gguf, gptq, awq, compressed-tensors"):
        quantization_of({"quantization_config": {"quant_method": "bitsandbytes"}})


def test_incomplete_quantized_module_is_named():
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}
    stream = [("model.layers.0.mlp.up_proj.qweight", torch.zeros(4, 8, dtype=torch.int32)),
              ("model.norm.weight", torch.ones(8))]
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj' lacks qzeros, scales"):
        list(quantized_tensors("gptq", config, iter(stream)))
