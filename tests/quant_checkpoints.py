"""Quantized checkpoints of a tiny random HF model, in each format's real on-disk layout.

Every writer takes a full-precision checkpoint directory (tests/tiny_models.py), quantizes its
decoder linears by round-to-nearest per group, packs them as the format stores them, writes
config.json (with quantization_config) + model.safetensors (+ the tokenizer) into out_dir, and
returns the float32 HF-named state dict the written weights mean: load that into transformers
for a reference model. GGUF files come from tests/quant_gguf_writer.write_gguf.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.quant_gguf_writer import write_gguf

__all__ = ["assert_same_weights", "build_quant_model", "write_awq", "write_compressed_tensors",
           "write_gguf", "write_gptq"]

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The other families' decoder linears, as AutoGPTQ and AutoAWQ quantize them: Mixtral's experts
# (not its router), GPT-NeoX's and OPT's projections.
FAMILY_LINEARS = ("w1", "w2", "w3", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
                  "out_proj", "fc1", "fc2")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def build_quant_model(out_dir: str | Path) -> Path:
    """The tiny random Llama every format is written from: rows of 256 values (hidden 256,
    intermediate 512), as llama.cpp's K-quants need."""
    from tests.tiny_models import build_tiny_model
    return build_tiny_model(out_dir, hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=1)


def assert_same_weights(got: dict, reference: dict, rtol: float = 1e-6) -> None:
    """What a reader yielded (tensors or QuantWeights) equals the reference float weights."""
    from pagedserve.kernels.quantized import QuantWeight
    from pagedserve.kernels.reference import dequantize_weight
    assert set(got) == set(reference)
    for name, ref in reference.items():
        value = got[name]
        value = dequantize_weight(value) if isinstance(value, QuantWeight) else value.float()
        torch.testing.assert_close(value, ref.float(), rtol=rtol, atol=rtol * ref.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


# Greedy tokens of a quantized model may differ from its dequantized reference's only where the
# reference's two top logits are this close.
TIE = 1e-3


def greedy_with_gaps(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """A transformers model's greedy tokens for one prompt, and the gap between its top two
    logits at each of them."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    gaps = [float(s[0].float().topk(2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


def assert_greedy_matches_up_to_ties(got: list[int], want: list[int], gaps: list[float]) -> None:
    """got equals want, or first differs where the reference itself nearly tied (gap < TIE)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[i] < TIE, f"token {i}: {a} vs {b}, reference top-2 gap {gaps[i]:.2e}"
            return
    assert len(got) == len(want)


def is_quantized_linear(name: str) -> bool:
    parts = name.split(".")
    return ("layers" in parts and name.endswith(".weight")
            and parts[-2] in LINEARS + FAMILY_LINEARS)


def _copy_checkpoint(model_dir: Path, out_dir: Path, quantization_config: dict) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.is_file() and file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, out_dir / file.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    from safetensors.torch import load_file
    return load_file(str(model_dir / "model.safetensors"))


def _save(tensors: dict, out_dir: Path) -> None:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))


def rtn(weight: torch.Tensor, bits: int, group_index: torch.Tensor, groups: int, sym: bool,
        min_zero: int = 0):
    """Round-to-nearest: weight [n, k], group_index [k] -> (q [n, k] unsigned, scales [groups, n]
    float16, zeros [groups, n] int) with weight ~ (q - zero) * scale."""
    n, k = weight.shape
    top = 2 ** bits - 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = weight[:, group_index == g]
        if sym:
            scales[g] = cols.abs().amax(1).clamp_min(1e-8) * 2 / top
            zeros[g] = 2 ** (bits - 1)
        else:
            low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[g] = ((high - low) / top).clamp_min(1e-8)
            zeros[g] = torch.round(-low / scales[g].half().float()).clamp(min_zero, top).long()
    scales = scales.half()
    s, z = scales.float()[group_index].t(), zeros[group_index].t()  # [n, k]
    q = (torch.round(weight / s) + z).clamp(0, top).long()
    return q, scales, zeros


def _pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed 32 // bits to an int32 word along dim (value i at bits i * bits)."""
    per_word = 32 // bits
    v = values.long()
    if dim == 0:
        v = v.reshape(v.shape[0] // per_word, per_word, v.shape[1])
        shifts = (torch.arange(per_word) * bits).view(1, per_word, 1)
        words = (v << shifts).sum(1)
    else:
        v = v.reshape(v.shape[0], v.shape[1] // per_word, per_word)
        words = (v << (torch.arange(per_word) * bits)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def write_gptq(model_dir, out_dir, *, bits: int = 4, group_size: int = 32, sym: bool = True,
               desc_act: bool = False, checkpoint_format: str = "gptq", seed: int = 0) -> dict:
    """An AutoGPTQ-layout checkpoint; desc_act shuffles the channel order (g_idx) at random."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
              "sym": sym, "checkpoint_format": checkpoint_format, "damp_percent": 0.01,
              "true_sequential": True, "static_groups": False}
    state = _copy_checkpoint(model_dir, out_dir, config)
    generator = torch.Generator().manual_seed(seed)
    tensors, reference = {}, {}
    for name, weight in state.items():
        if not is_quantized_linear(name):
            tensors[name] = reference[name] = weight
            continue
        n, k = weight.shape
        size = k if group_size == -1 else group_size
        order = torch.randperm(k, generator=generator) if desc_act else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // size  # the channels quantized g-th form group g
        # v1 stores z - 1, which AutoGPTQ's packing cannot hold for z = 0.
        q, scales, zeros = rtn(weight.float(), bits, g_idx, k // size, sym,
                               min_zero=1 if checkpoint_format == "gptq" else 0)
        stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = _pack_int32(q.t(), bits, dim=0)
        tensors[f"{prefix}.qzeros"] = _pack_int32(stored_zeros, bits, dim=1)
        tensors[f"{prefix}.scales"] = scales
        tensors[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        reference[name] = ((q - zeros[g_idx].t()) * scales.float()[g_idx].t()).float()
    _save(tensors, out_dir)
    return reference


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [rows, cols] -> AWQ's int32 [rows, cols / 8] (interleaved order)."""
    rows, cols = values.shape
    grouped = values.reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)]
    return _pack_int32(grouped.reshape(rows, cols), 4, dim=1)


def write_awq(model_dir, out_dir, *, group_size: int = 32) -> dict:
    """An AutoAWQ GEMM-layout checkpoint (4-bit, zero points)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": None}
    state = _copy_checkpoint(model_dir, out_dir, config)
    tensors, reference = {}, {}
    for name, weight in state.items():
        if not is_quantized_linear(name):
            tensors[name] = reference[name] = weight
            continue
        n, k = weight.shape
        g_idx = torch.arange(k) // group_size
        q, scales, zeros = rtn(weight.float(), 4, g_idx, k // group_size, sym=False)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = _pack_awq(q.t())
        tensors[f"{prefix}.qzeros"] = _pack_awq(zeros)
        tensors[f"{prefix}.scales"] = scales
        reference[name] = ((q - zeros[g_idx].t()) * scales.float()[g_idx].t()).float()
    _save(tensors, out_dir)
    return reference


def write_compressed_tensors(model_dir, out_dir, *, bits: int = 4, strategy: str = "group",
                             group_size: int | None = 32, symmetric: bool = True,
                             format: str = "pack-quantized") -> dict:
    """A checkpoint as llm-compressor saves one, packed by compressed-tensors' own compressor
    (the reference is its own decompressor's output)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme,
    )

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=format)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=format,
                                quantization_status="compressed", ignore=["lm_head"])
    state = _copy_checkpoint(model_dir, out_dir, config.model_dump(mode="json"))
    compressor = BaseCompressor.get_value_from_registry(format)
    tensors, reference = {}, {}
    for name, weight in state.items():
        if not is_quantized_linear(name):
            tensors[name] = reference[name] = weight
            continue
        n, k = weight.shape
        size = {"group": group_size, "channel": k, "tensor": k}[strategy]
        g_idx = torch.arange(k) // size
        q, scales, zeros = rtn(weight.float(), bits, g_idx, k // size, symmetric)
        scale = scales.t().contiguous()  # [n, groups]
        if strategy == "tensor":
            scale = scale.amax().reshape(1)
        parts = {"weight": weight.half(), "weight_scale": scale.half()}
        if not symmetric:
            parts["weight_zero_point"] = (zeros.t() - 2 ** (bits - 1)).to(torch.int8).contiguous()
        compressed = compressor.compress(parts, scheme)
        prefix = name.removesuffix(".weight")
        for piece, value in compressed.items():
            tensors[f"{prefix}.{piece}"] = value
        # decompressed in float32: the exact value of the stored float16 scales times the integers
        exact = {**compressed, "weight_scale": compressed["weight_scale"].float()}
        reference[name] = compressor.decompress(exact, scheme)["weight"].float()
    _save(tensors, out_dir)
    return reference
