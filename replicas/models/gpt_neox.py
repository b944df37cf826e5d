"""GPT-NeoX / Pythia: LayerNorms with bias, rotary on the first rotary_pct of each head, and the
parallel residual (x + attn(ln1(x)) + mlp(ln2(x))) or, with use_parallel_residual=False, the
sequential one.

The checkpoint's fused query_key_value interleaves heads ([q|k|v] per head); load reorders its
rows to our [all q | all k | all v]. That layout makes a tensor-parallel rank's heads one block
of rows, read as is and reordered the same way; the rest shards as Llama does (dense and
dense_4h_to_h row-parallel, dense_h_to_4h column-parallel, embed_in and embed_out by vocabulary).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.replicas.models.attention import Attention
from pagedserve.replicas.models.causal_lm import CausalLM
from pagedserve.replicas.models.layers import LayerNorm
from pagedserve.replicas.models.mlp import MLP
from pagedserve.replicas.models.rotary import RotaryEmbedding
from pagedserve.replicas.parallel.layers import vocab_embedding
from pagedserve.replicas.parallel.sharding import Shard, row_parallel

# Our module -> GPT-NeoX's, inside a layer.
_NAMES = {"attention.qkv_proj": "attention.query_key_value", "attention.o_proj": "attention.dense",
          "mlp.up_proj": "mlp.dense_h_to_4h", "mlp.down_proj": "mlp.dense_4h_to_h"}


class GPTNeoXLayer(nn.Module):
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        bias = bool(getattr(config, "attention_bias", True))
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = LayerNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = LayerNorm(hidden, eps, dtype, device)
        self.attention = Attention(hidden_size=hidden, num_heads=config.num_attention_heads,
                                   num_kv_heads=config.num_attention_heads,
                                   head_dim=hidden // config.num_attention_heads, backend=backend,
                                   dtype=dtype, device=device, qkv_bias=bias, o_bias=bias)
        self.mlp = MLP(hidden, config.intermediate_size, config.hidden_act, dtype, device)

    def forward(self, rotary, hidden, kv_cache, attn_metadata):
        attn = self.attention(rotary, self.input_layernorm(hidden), kv_cache, attn_metadata)
        if self.use_parallel_residual:
            return hidden + attn + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GPTNeoXModel(nn.Module):
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim, config.max_position_embeddings, dtype, device)
        self.embed_in = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(GPTNeoXLayer(config, backend, dtype, device)
                                    for _ in range(config.num_hidden_layers))
        self.final_layer_norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype, device)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden = self.embed_in(input_ids)
        rotary = self.rotary_emb(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(rotary, hidden, kv_cache, attn_metadata)
        return self.final_layer_norm(hidden)


class GPTNeoXForCausalLM(CausalLM):
    checkpoint_prefix = "gpt_neox."
    lm_head_name = "embed_out.weight"
    supports_tensor_parallel = True
    supports_quantized_tensor_parallel = True  # a quantized query_key_value shard is reordered too

    def __init__(self, config, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto", device: torch.device | str = "cpu"):
        super().__init__(config, dtype, attention_backend, device)
        self.gpt_neox = GPTNeoXModel(config, self.attention_backend, dtype, self.device)
        self._init_lm_head(self.gpt_neox.embed_in, config.hidden_size)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return self.gpt_neox(input_ids, positions, kv_caches, attn_metadata)

    def checkpoint_sources(self, name: str) -> list[tuple[str, slice | None]]:
        for ours, theirs in _NAMES.items():
            if f".{ours}." in name:
                return [(name.replace(f".{ours}.", f".{theirs}."), None)]
        return super().checkpoint_sources(name)

    def checkpoint_shard(self, hf_name: str, name: str) -> Shard | None:
        if name in ("gpt_neox.embed_in.weight", "lm_head.weight"):
            return Shard(0, ((self.vocab_start, self.vocab_stop),))
        parts = name.split(".")
        module = parts[-2]
        if module in ("o_proj", "down_proj"):
            size = self.config.hidden_size if module == "o_proj" else self.config.intermediate_size
            return row_parallel(self.tp, size, module, parts[-1] == "bias")
        if module == "qkv_proj":  # [heads, (q, k, v), head_dim] rows: this rank's heads in one block
            start, stop = self.tp.split(self.num_heads, "num_attention_heads")
            return Shard(0, ((start * 3 * self.head_dim, stop * 3 * self.head_dim),))
        if module == "up_proj":
            return Shard(0, (self.tp.split(self.config.intermediate_size, "intermediate_size"),))
        return None  # norms: every rank holds them whole

    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".query_key_value." not in hf_name:
            return tensor
        # [heads, (q, k, v), head_dim, ...] -> [(q, k, v), heads, head_dim, ...], over this rank's heads
        heads = tensor.shape[0] // (3 * self.head_dim)
        rows = tensor.view(heads, 3, self.head_dim, *tensor.shape[1:]).transpose(0, 1)
        return rows.reshape(tensor.shape)
