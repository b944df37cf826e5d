"""Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's differences.

Embeddings scaled by sqrt(hidden_size); (1 + w) RMSNorms (1 is added to w at load, so the fused
norm kernels run them unchanged); a norm after attention and on both sides of the MLP; a
gelu-tanh gated MLP; attention scaled by query_pre_attn_scalar; layers alternating between a
sliding window and global attention (config.layer_types). Gemma 2 soft-caps attention logits
and final logits; Gemma 3 instead normalises q and k per head and gives its sliding layers
their own rope base (rope_parameters per layer type). Names match Llama's checkpoints, and
under tensor parallelism they shard as Llama's do (the per-head q/k norms stay whole).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.replicas.models.attention import Attention, layer_windows
from pagedserve.replicas.models.causal_lm import head_dim_of
from pagedserve.replicas.models.layers import RMSNorm
from pagedserve.replicas.models.llama import LlamaForCausalLM
from pagedserve.replicas.models.mlp import GatedMLP
from pagedserve.replicas.models.rotary import RotaryEmbedding
from pagedserve.replicas.parallel.layers import vocab_embedding

def _is_gemma3(config) -> bool:
    return config.model_type.startswith("gemma3")


def _layer_types(config) -> list[str]:
    """From the config, not from the windows applied: rope follows the trained layer type."""
    return ["sliding_attention" if window else "full_attention" for window in layer_windows(config)]


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, window: int | None, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        gemma3 = _is_gemma3(config)
        self.self_attn = Attention(
            hidden_size=hidden, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config), backend=backend,
            dtype=dtype, device=device, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            scale=config.query_pre_attn_scalar ** -0.5, qk_norm_eps=eps if gemma3 else None,
            sliding_window=window,
            # transformers' Gemma 3 reads attn_logit_softcapping but never applies it
            logits_soft_cap=None if gemma3 else config.attn_logit_softcapping)
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.mlp = GatedMLP(hidden, config.intermediate_size, act, dtype, device)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device)

    def forward(self, rotary, hidden, residual, kv_cache, attn_metadata):
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rotary, hidden, kv_cache, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(self, config, windows: list[int | None], backend: AttentionBackend, dtype: torch.dtype,
                 device):
        super().__init__()
        head_dim, max_positions = head_dim_of(config), config.max_position_embeddings
        # Gemma 3: one rotary table per layer type; Gemma 2: one for all
        self.rotary_kinds = _layer_types(config) if _is_gemma3(config) else ["shared"] * len(windows)
        self.rotary_embs = nn.ModuleDict({
            kind: RotaryEmbedding(config, head_dim, max_positions, dtype, device,
                                  layer_type=None if kind == "shared" else kind)
            for kind in sorted(set(self.rotary_kinds))})
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device)
        # transformers rounds the scale to the model dtype first
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype))
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, window, backend, dtype, device)
                                    for window in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        rotary = {kind: table(positions) for kind, table in self.rotary_embs.items()}
        for layer, kind, kv_cache in zip(self.layers, self.rotary_kinds, kv_caches):
            hidden, residual = layer(rotary[kind], hidden, residual, kv_cache, attn_metadata)
        return self.norm(hidden, residual)[0]


class GemmaForCausalLM(LlamaForCausalLM):
    supports_quantized_tensor_parallel = True  # convert() changes only the norms, never quantized

    def build_model(self, config) -> nn.Module:
        self.final_logit_soft_cap = getattr(config, "final_logit_softcapping", None)
        return GemmaModel(config, self.sliding_windows, self.attention_backend, self.dtype, self.device)

    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        if hf_name.endswith("norm.weight"):
            return tensor.float() + 1.0  # (1 + w), as transformers computes it in float32
        return tensor
