"""Quantized weights in the model layers: a model whose projections and embeddings are loaded
as QuantWeights computes what the same model computes on their dequantized float32 values,
allocates no dense storage for them, and refuses what a quantized layout cannot follow."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.quantized import QuantWeight, pack_values
from pagedserve.kernels.reference import dequantize_weight
from pagedserve.replicas.models.loader import iterate_weights, load_config, weight_files
from pagedserve.replicas.models import get_model_class
from pagedserve.replicas.models.layers import Embedding, Linear, deferred_weights
from tests.engine.test_model import make_prompts, new_kv_caches, run_step

QUANTIZED_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def rtn(weight: torch.Tensor, bits: int, group_size: int) -> QuantWeight:
    """Round-to-nearest asymmetric quantization of a dense [n, k] weight."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / (2 ** bits - 1)).clamp_min(1e-8)
    q = ((groups - low.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 2 ** bits - 1)
    return QuantWeight(bits, group_size, pack_values(q.view(n, k), bits), scales.contiguous(),
                       low.contiguous())


def checkpoint(path, bits_of) -> tuple[list, list]:
    """The checkpoint's tensors twice: with QuantWeights, and with their dequantized values."""
    quantized, dense = [], []
    for name, tensor in iterate_weights(weight_files(path), progress=False):
        bits = bits_of(name) if name.endswith(QUANTIZED_SUFFIXES) else None
        if bits is None:
            quantized.append((name, tensor))
            dense.append((name, tensor))
        else:
            weight = rtn(tensor, bits, 16)
            quantized.append((name, weight))
            dense.append((name, dequantize_weight(weight)))
    return quantized, dense


def build(path, tensors, deferred: bool):
    config = load_config(path)
    with deferred_weights() if deferred else torch.device("cpu"):
        model = get_model_class(config)(config, torch.float32, "reference")
    model.load_weights(tensors)
    model.eval()
    model.pack_weights()
    return model


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_a_quantized_model_computes_its_dequantized_values(name, tiny_model_dir, tmp_path):
    from tests.tiny_models import build_tiny_model
    path = (tiny_model_dir("llama") if name == "llama" else
            build_tiny_model(tmp_path, "llama", tie_word_embeddings=True, seed=7))
    # Mixed bits inside one fused projection (q 4-bit, k/v 8-bit) as GGUF mixes allow.
    quantized, dense = checkpoint(path, lambda n: 8 if ("k_proj" in n or "v_proj" in n
                                                        or "embed" in n) else 4)
    model, reference = build(path, quantized, True), build(path, dense, False)
    for module in model.modules():  # no dense copy of a quantized weight is kept
        if isinstance(module, (Linear, Embedding)):
            assert module.weight.numel() == 0 and not module.weight.is_meta
    prompts = make_prompts(model.vocab_size)
    caches, reference_caches = new_kv_caches(model), new_kv_caches(reference)
    seqs = [(p, 0, i) for i, p in enumerate(prompts)]
    for got, want in zip(run_step(model, caches, seqs), run_step(reference, reference_caches, seqs)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_fused_projection_quantized_in_part_is_refused(tiny_model_dir):
    path = tiny_model_dir("llama")
    quantized, _ = checkpoint(path, lambda n: 4 if "q_proj" in n else None)
    with pytest.raises(ValueError, match="quantized in all of its parts"):
        build(path, quantized, True)


def test_a_quantized_norm_is_refused(tiny_model_dir):
    path = tiny_model_dir("llama")
    quantized, _ = checkpoint(path, lambda n: None)
    quantized = [(n, rtn(t.view(1, -1), 8, t.numel()) if n.endswith("model.norm.weight") else t)
                 for n, t in quantized]
    with pytest.raises(ValueError, match="only projection and embedding weights"):
        build(path, quantized, True)
