"""What a GGUF file's metadata and tensor names mean in Hugging Face terms: the transformers
config of its architecture, and the HF name of each tensor.

llama.cpp's converter (convert_hf_to_gguf.py) renames every tensor and, for the llama
architecture only, permutes the rows of q_proj and k_proj (weights and biases) from HF's
rotate-half rope layout into GPT-J's interleaved one; `unpermute_rows` is the inverse.
"""
from __future__ import annotations

import re

import torch

# GGUF architecture -> (transformers config class, HF architecture name).
ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
PERMUTED_ARCHITECTURES = ("llama",)

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor; None if it has none here."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"


def llama_cpp_row_order(rows: int, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's permute as a row index: gguf_rows = hf_rows[index]."""
    head = rows // num_heads
    return torch.arange(rows).view(num_heads, 2, head // 2).transpose(1, 2).reshape(rows)


def unpermute_rows(hf_name: str, rows: int, config) -> torch.Tensor | None:
    """The row index that turns a llama-arch GGUF q/k tensor back into HF order (None: leave it)."""
    if ".self_attn.q_proj." in hf_name:
        heads = config.num_attention_heads
    elif ".self_attn.k_proj." in hf_name:
        heads = config.num_key_value_heads
    else:
        return None
    return torch.argsort(llama_cpp_row_order(rows, heads))


def _one(value, key: str):
    """A per-layer array whose entries all agree -> the entry."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF metadata {key} varies between layers ({value}): not supported")
        return value[0]
    return value


def build_config(metadata: dict, tensor_names: set[str], embedding_rows: int, path: str,
                 rope_freqs: list[float] | None = None):
    """The transformers config of the model a GGUF file holds (rope_freqs: the values of its
    rope_freqs.weight tensor, if it has one)."""
    import transformers

    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path!r}: GGUF architecture {arch!r} is not supported: supported are "
                         f"{', '.join(ARCHITECTURES)}")

    def field(key: str, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path!r}: GGUF metadata lacks {arch}.{key}")
        return _one(value, f"{arch}.{key}")

    hidden = field("embedding_length")
    heads = field("attention.head_count")
    head_dim = field("attention.key_length", hidden // heads)
    rotary_dim = field("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"{path!r}: partial rotary embeddings ({rotary_dim} of {head_dim}) are not "
                         "supported for GGUF files")
    config_class, architecture = ARCHITECTURES[arch]
    fields = dict(
        vocab_size=embedding_rows, hidden_size=hidden, num_hidden_layers=field("block_count"),
        intermediate_size=field("feed_forward_length"), num_attention_heads=heads,
        num_key_value_heads=field("attention.head_count_kv", heads), head_dim=head_dim,
        max_position_embeddings=field("context_length"),
        rms_norm_eps=field("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        architectures=[architecture],
    )
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in metadata:
            fields[key] = metadata[f"tokenizer.ggml.{name}_token_id"]
    scaling = rope_scaling(metadata, arch, path)
    if rope_freqs is not None:
        scaling = frequency_factors_scaling(rope_freqs, fields["rope_theta"], head_dim,
                                            fields["max_position_embeddings"])
    if scaling is not None:
        fields["rope_scaling"] = scaling
    return getattr(transformers, config_class)(**fields)


def rope_scaling(metadata: dict, arch: str, path: str) -> dict | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ValueError(f"{path!r}: rope scaling type {kind!r} is not supported (supported: none, "
                     "linear, yarn)")


# Llama 3.x fields tried when fitting rope_freqs.weight (factor comes from the tensor itself).
LLAMA3_LOW_FREQ_FACTORS = (1.0, 2.0)
LLAMA3_HIGH_FREQ_FACTORS = (4.0, 8.0)
LLAMA3_ORIGINAL_CONTEXTS = tuple(2 ** n for n in range(4, 18))


def frequency_factors_scaling(factors: list[float], theta: float, head_dim: int,
                              context_length: int) -> dict | None:
    """rope_freqs.weight (per frequency, the divisor convert_hf_to_gguf writes for Llama 3.1-style
    rope) -> a rope_scaling giving the same frequencies: the llama3 fields that reproduce it, or
    else, exactly, longrope with these factors for every length and no attention scaling."""
    from pagedserve.replicas.models.rotary import inverse_frequencies

    target = torch.tensor(factors, dtype=torch.float32)
    if torch.all(target == 1):
        return None
    base = {"rope_theta": theta, "rope_type": "default"}
    plain = inverse_frequencies(None, head_dim, base)
    factor = float(target.max())
    for original in LLAMA3_ORIGINAL_CONTEXTS:
        for low in LLAMA3_LOW_FREQ_FACTORS:
            for high in LLAMA3_HIGH_FREQ_FACTORS:
                scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                           "high_freq_factor": high, "original_max_position_embeddings": original}
                if torch.allclose(inverse_frequencies(None, head_dim, {**base, **scaling}),
                                  plain / target, rtol=1e-5, atol=0):
                    return scaling
    return {"rope_type": "longrope", "short_factor": factors, "long_factor": factors, "factor": 1.0,
            "original_max_position_embeddings": context_length, "attention_factor": 1.0}
