"""GPT-2: learned absolute positions, pre-LayerNorm (with bias), gelu_new, a tied lm_head.

Its checkpoints store projections as Conv1D weights ([in, out]); they are transposed once at load
into our [out, in] Linear layout. c_attn is already q|k|v fused, in our row order.

Under tensor parallelism it shards as Llama does (q/k/v by head and c_fc column-parallel, both
c_proj row-parallel, wte by vocabulary rows); the learned position table stays whole on every
rank. A Conv1D weight's output features are its columns, so column-parallel weights split dim 1
and row-parallel ones dim 0 (the reverse of a Linear's).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.replicas.models.attention import Attention
from pagedserve.replicas.models.causal_lm import CausalLM
from pagedserve.replicas.models.layers import Embedding, LayerNorm
from pagedserve.replicas.models.mlp import MLP
from pagedserve.replicas.parallel.layers import vocab_embedding
from pagedserve.replicas.parallel.sharding import Shard, row_parallel

# Our module -> GPT-2's, inside a block (h.N.).
_NAMES = {"attn.qkv_proj": "attn.c_attn", "attn.o_proj": "attn.c_proj",
          "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}


def intermediate_size(config) -> int:
    return config.n_inner or 4 * config.hidden_size


class GPT2Block(nn.Module):
    def __init__(self, config, layer: int, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        scale = (config.hidden_size // config.num_attention_heads) ** -0.5 if config.scale_attn_weights else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer + 1
        self.ln_1 = LayerNorm(hidden, eps, dtype, device)
        self.attn = Attention(hidden_size=hidden, num_heads=config.num_attention_heads,
                              num_kv_heads=config.num_attention_heads,
                              head_dim=hidden // config.num_attention_heads, backend=backend,
                              dtype=dtype, device=device, qkv_bias=True, o_bias=True, scale=scale)
        self.ln_2 = LayerNorm(hidden, eps, dtype, device)
        self.mlp = MLP(hidden, intermediate_size(config), config.activation_function, dtype, device)

    def forward(self, hidden, kv_cache, attn_metadata):
        hidden = hidden + self.attn(None, self.ln_1(hidden), kv_cache, attn_metadata)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        self.wte = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size, dtype, device)
        self.h = nn.ModuleList(GPT2Block(config, i, backend, dtype, device)
                               for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon, dtype, device)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            hidden = block(hidden, kv_cache, attn_metadata)
        return self.ln_f(hidden)


class GPT2LMHeadModel(CausalLM):
    checkpoint_prefix = "transformer."  # GPT2Model checkpoints (the original gpt2) lack it
    supports_tensor_parallel = True

    def __init__(self, config, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto", device: torch.device | str = "cpu"):
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention (add_cross_attention) is not supported")
        super().__init__(config, dtype, attention_backend, device)
        self.transformer = GPT2Model(config, self.attention_backend, dtype, self.device)
        self._init_lm_head(self.transformer.wte, config.hidden_size)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return self.transformer(input_ids, positions, kv_caches, attn_metadata)

    def checkpoint_sources(self, name: str) -> list[tuple[str, slice | None]]:
        for ours, theirs in _NAMES.items():
            if f".{ours}." in name:
                return [(name.replace(f".{ours}.", f".{theirs}."), None)]
        return [(name, None)]

    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        is_conv1d = hf_name.endswith(".weight") and any(f".{theirs}." in hf_name for theirs in _NAMES.values())
        return tensor.t() if is_conv1d else tensor

    def checkpoint_shard(self, hf_name: str, name: str) -> Shard | None:
        if name in ("transformer.wte.weight", "lm_head.weight"):
            return Shard(0, ((self.vocab_start, self.vocab_stop),))
        parts = name.split(".")
        module, kind = parts[-2], parts[-1]
        if module in ("o_proj", "down_proj"):
            size = self.config.hidden_size if module == "o_proj" else intermediate_size(self.config)
            return row_parallel(self.tp, size, module, kind == "bias", dim=0)
        if module == "qkv_proj":  # this rank's heads of each of q, k, v
            start, stop = self.tp.split(self.num_heads, "num_attention_heads")
            width, hd = self.num_heads * self.head_dim, self.head_dim
            ranges = tuple((part * width + start * hd, part * width + stop * hd) for part in range(3))
        elif module == "up_proj":
            ranges = (self.tp.split(intermediate_size(self.config), "n_inner"),)
        else:
            return None  # norms and the position table: every rank holds them whole
        return Shard(1 if kind == "weight" else 0, ranges)
