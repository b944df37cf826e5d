"""OPT: learned positions offset by 2, ReLU MLP, LayerNorm before (do_layer_norm_before) or after
each block, and where word_embed_proj_dim != hidden_size (opt-350m) embeddings projected in and
the final states projected out.

Under tensor parallelism it shards as Llama does: q/k/v by head and fc1 column-parallel, out_proj
and fc2 row-parallel, embed_tokens (the tied lm_head) by vocabulary rows; the learned position
table and project_in / project_out stay whole on every rank, as in vLLM.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.replicas.models.attention import Attention
from pagedserve.replicas.models.causal_lm import CausalLM, split_rows
from pagedserve.replicas.models.layers import Embedding, LayerNorm, Linear, activation
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.parallel.layers import vocab_embedding
from pagedserve.replicas.parallel.sharding import Shard, row_parallel

POSITION_OFFSET = 2  # OPT's learned position table starts at row 2 (fairseq's padding legacy)


def _layer_norm(config, dtype, device) -> LayerNorm:
    return LayerNorm(config.hidden_size, 1e-5, dtype, device,
                     affine=getattr(config, "layer_norm_elementwise_affine", True))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        hidden, bias = config.hidden_size, config.enable_bias
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = Attention(hidden_size=hidden, num_heads=config.num_attention_heads,
                                   num_kv_heads=config.num_attention_heads,
                                   head_dim=hidden // config.num_attention_heads, backend=backend,
                                   dtype=dtype, device=device, qkv_bias=bias, o_bias=bias)
        self.self_attn_layer_norm = _layer_norm(config, dtype, device)
        self.tp = parallel_state.current()  # fc1 holds this rank's share of ffn_dim's rows
        ffn_dim = config.ffn_dim // self.tp.world_size
        self.fc1 = Linear(hidden, ffn_dim, bias, dtype, device)
        self.fc2 = Linear(ffn_dim, hidden, bias, dtype, device)
        self.act = activation(config.activation_function)
        self.final_layer_norm = _layer_norm(config, dtype, device)

    def forward(self, hidden, kv_cache, attn_metadata):
        pre = self.do_layer_norm_before
        attn_in = self.self_attn_layer_norm(hidden) if pre else hidden
        hidden = hidden + self.self_attn(None, attn_in, kv_cache, attn_metadata)
        if not pre:
            hidden = self.self_attn_layer_norm(hidden)
        mlp_in = self.final_layer_norm(hidden) if pre else hidden
        mlp_out = self.fc2(self.act(self.fc1(mlp_in)))
        hidden = hidden + (mlp_out if self.tp.world_size == 1 else self.tp.all_reduce(mlp_out))
        return hidden if pre else self.final_layer_norm(hidden)


class OPTDecoder(nn.Module):
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = vocab_embedding(config.vocab_size, proj, dtype, device)
        self.embed_positions = Embedding(config.max_position_embeddings + POSITION_OFFSET, hidden, dtype, device)
        self.project_in = Linear(proj, hidden, False, dtype, device) if proj != hidden else None
        self.project_out = Linear(hidden, proj, False, dtype, device) if proj != hidden else None
        has_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = _layer_norm(config, dtype, device) if has_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, backend, dtype, device)
                                    for _ in range(config.num_hidden_layers))

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, kv_cache, attn_metadata)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)


class OPTModel(nn.Module):
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        self.decoder = OPTDecoder(config, backend, dtype, device)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return self.decoder(input_ids, positions, kv_caches, attn_metadata)


class OPTForCausalLM(CausalLM):
    supports_tensor_parallel = True
    supports_quantized_tensor_parallel = True

    def __init__(self, config, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto", device: torch.device | str = "cpu"):
        super().__init__(config, dtype, attention_backend, device)
        self.model = OPTModel(config, self.attention_backend, dtype, self.device)
        self._init_lm_head(self.model.decoder.embed_tokens, config.word_embed_proj_dim)

    def checkpoint_sources(self, name: str) -> list[tuple[str, slice | None]]:
        if ".self_attn.qkv_proj." in name:
            names = [name.replace(".qkv_proj.", f".{hf}.") for hf in ("q_proj", "k_proj", "v_proj")]
            return split_rows([self.config.hidden_size // self.tp.world_size] * 3, names)
        return super().checkpoint_sources(name.replace(".self_attn.o_proj.", ".self_attn.out_proj."))

    def checkpoint_shard(self, hf_name: str, name: str) -> Shard | None:
        if name in ("model.decoder.embed_tokens.weight", "lm_head.weight"):
            return Shard(0, ((self.vocab_start, self.vocab_stop),))
        parts = name.split(".")
        module = parts[-2]
        if module in ("o_proj", "fc2"):
            size = self.config.hidden_size if module == "o_proj" else self.config.ffn_dim
            return row_parallel(self.tp, size, module, parts[-1] == "bias")
        if module == "qkv_proj":  # q, k and v each: this rank's heads
            start, stop = self.tp.split(self.num_heads, "num_attention_heads")
            return Shard(0, ((start * self.head_dim, stop * self.head_dim),))
        if module == "fc1":
            return Shard(0, (self.tp.split(self.config.ffn_dim, "ffn_dim"),))
        return None  # norms, positions, project_in / project_out: every rank holds them whole
