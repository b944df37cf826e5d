"""Writing a tiny HF model as a GGUF file, the way llama.cpp's convert_hf_to_gguf.py does: its
tensor names, q/k row permutation, metadata and tokenizer keys, each weight in a chosen GGML type.

The gguf package quantizes Q4_0 ... Q8_0 itself; it has no quantizer for the K-quants, so this
file encodes those by round-to-nearest into ggml's block layout (any valid block is a fine test;
gguf.quants.dequantize then tells what the bytes mean).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{suffix}"


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in behaviour."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _k_scales_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [nb, 8] -> Q4_K/Q5_K's 12 packed bytes [nb, 12]."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _k_affine(x: np.ndarray, levels: int):
    """x [nb, 8, 32] -> (d, dmin, sc, mn, q) of a Q4_K / Q5_K encoding."""
    low = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - low) / levels
    d, dmin = _f16(scale.max(-1) / 63), _f16(-low.min(-1) / 63)
    sc = np.clip(np.round(_safe_div(scale, d[:, None].astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(-low, dmin[:, None].astype(np.float32))), 0, 63).astype(np.uint8)
    eff_scale = d[:, None].astype(np.float32) * sc
    eff_min = dmin[:, None].astype(np.float32) * mn
    q = np.clip(np.round(_safe_div(x + eff_min[..., None], eff_scale[..., None])), 0, levels)
    return d, dmin, sc, mn, q.astype(np.uint8)


def _nibble_chunks(q: np.ndarray) -> np.ndarray:
    """[nb, 8, 32] 4-bit values -> K-quant qs [nb, 128]: sub-blocks 2c / 2c + 1 share 32 bytes."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(q.shape[0], 128)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _k_affine(x, 15)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _k_scales_bytes(sc, mn), _nibble_chunks(q)], axis=1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _k_affine(x, 31)
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for sub in range(8):
        qh |= ((q[:, sub] >> 4) & 1) << sub
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                           _k_scales_bytes(sc, mn), qh, _nibble_chunks(q & 0xF)], axis=1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.round(_safe_div(scale, d[:, None].astype(np.float32))), -128, 127).astype(np.int8)
    eff = d[:, None].astype(np.float32) * sc
    u = (np.clip(np.round(_safe_div(x, eff[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    low, high = u & 0xF, u >> 4
    ql = np.concatenate([low[:, h * 128:h * 128 + 64] | (low[:, h * 128 + 64:h * 128 + 128] << 4)
                         for h in range(2)], axis=1)
    qh = np.concatenate([sum(high[:, h * 128 + t * 32:h * 128 + t * 32 + 32] << (2 * t) for t in range(4))
                         for h in range(2)], axis=1).astype(np.uint8)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)


def quantize(weight: np.ndarray, qtype) -> np.ndarray:
    """A float [n, k] weight -> its GGML bytes [n, row bytes] in type qtype."""
    import gguf
    if qtype.name in K_TYPES:
        encoder = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}[qtype.name]
        return encoder(weight).reshape(weight.shape[0], -1)
    if qtype == gguf.GGMLQuantizationType.BF16:
        return gguf.quants.quantize(weight, qtype)
    return gguf.quants.quantize(weight.astype(np.float32), qtype)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs.weight for a llama3 rope_scaling."""
    import math
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def tokenizer_metadata(writer, model_dir: Path, config) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer keys."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if config.pad_token_id is not None:
        writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)


def write_gguf(model_dir: str | Path, path: str | Path, weight_type: str = "Q8_0",
               embedding_type: str | None = None, output_type: str | None = None,
               arch: str = "llama") -> tuple[Path, dict[str, torch.Tensor]]:
    """The HF checkpoint in model_dir as a GGUF file: every 2-D weight in weight_type (the token
    embedding in embedding_type, lm_head in output_type when given), 1-D tensors in F32.

    Returns (path, reference): the float32 HF-named state dict the file's bytes mean, from
    gguf.quants.dequantize (q/k rows put back in HF order with transformers' own inverse)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model_dir, path = Path(model_dir), Path(path)
    config = AutoConfig.from_pretrained(str(model_dir))
    state = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    tokenizer_metadata(writer, model_dir, config)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    processor = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    reference = {}
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(data, heads, heads if ".q_proj." in name else kv_heads)
        kind = "F32" if data.ndim == 1 else weight_type
        if name == "model.embed_tokens.weight" and embedding_type:
            kind = embedding_type
        if name == "lm_head.weight" and output_type:
            kind = output_type
        qtype = gguf.GGMLQuantizationType[kind]
        stored = data if kind == "F32" else quantize(data, qtype)
        if kind in ("F32", "F16"):
            stored = data.astype(np.float16) if kind == "F16" else data
            writer.add_tensor(gguf_name(name), stored)
        else:
            writer.add_tensor(gguf_name(name), stored, raw_dtype=qtype)  # bytes: shape derived
        value = gguf.quants.dequantize(stored.view(np.uint8) if kind not in ("F32", "F16") else stored, qtype)
        value = np.asarray(value, dtype=np.float32).reshape(data.shape)
        if arch == "llama":
            value = processor.process(value, gguf_name(name)).weights
        reference[name] = torch.from_numpy(np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, reference
