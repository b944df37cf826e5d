"""The Llama-shaped decoders: Llama, Mistral, Qwen2, Qwen3 and Phi-3.

Their differences are config fields: grouped-query attention, an explicit head_dim, q/k/v biases
(Qwen2), per-head q/k RMSNorm (Qwen3), rope scaling (llama3, linear, Phi-3's longrope, a partial
rotary dim), sliding windows, tied embeddings. q/k/v and gate/up are fused into one matmul each:
at load time from separate checkpoint tensors, or as Phi-3's checkpoints already store them.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import norm_act
from pagedserve.kernels.backend import AttentionBackend
from pagedserve.kernels.decoder_layers import DecoderStack, LayerWeights, LoRAPart, Projection
from pagedserve.replicas.models.attention import Attention
from pagedserve.replicas.models.causal_lm import CausalLM, head_dim_of, split_rows
from pagedserve.replicas.models.layers import Linear, RMSNorm
from pagedserve.replicas.models.mlp import GatedMLP
from pagedserve.replicas.models.rotary import RotaryEmbedding
from pagedserve.replicas.parallel.layers import vocab_embedding
from pagedserve.replicas.parallel.sharding import Shard, kv_head_start, row_parallel


def llama_attention(config, layer: int, window: int | None, backend: AttentionBackend,
                    dtype: torch.dtype, device) -> Attention:
    is_qwen2 = config.model_type == "qwen2"  # q/k/v biases, none on o_proj
    attention_bias = bool(getattr(config, "attention_bias", False))
    return Attention(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                     num_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config),
                     backend=backend, dtype=dtype, device=device,
                     qkv_bias=is_qwen2 or attention_bias, o_bias=attention_bias and not is_qwen2,
                     qk_norm_eps=config.rms_norm_eps if config.model_type == "qwen3" else None,
                     sliding_window=window)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module, dtype: torch.dtype, device):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, rotary, hidden, residual, kv_cache, attn_metadata):
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it).

        The residual add is fused into the next norm; the first layer gets residual None.
        """
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotary, hidden, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, layers: list[nn.Module], dtype: torch.dtype, device):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings,
                                          dtype, device)
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.dtype = dtype
        self.decoder_stack: DecoderStack | None = None  # set by after_packing where it applies
        self.lora_step = None  # under LoRA: each row's adapter slot (replicas/lora/slots.py)

    def after_packing(self) -> None:
        """Decode steps go through every layer in one native call where the layers qualify
        (kernels/decoder_layers.py): the same kernels, without the Python between them."""
        weights = [_layer_weights(layer) for layer in self.layers]
        if not weights or None in weights:
            return
        attn, eps = self.layers[0].self_attn, self.layers[0].input_layernorm.eps
        if any(layer.self_attn.scale != attn.scale or layer.input_layernorm.eps != eps
               for layer in self.layers):
            return
        self.decoder_stack = DecoderStack.build(
            weights, dtype=self.dtype, hidden_size=self.norm.weight.shape[0], num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate_size=self.layers[0].mlp.intermediate_size, eps=eps, scale=attn.scale)

    def attach_lora(self, step) -> None:
        """LoRA slots are on the projections (replicas/lora): steps with adapter rows read their
        slots from `step`, and take the decoder stack where it takes the slots too."""
        self.lora_step = step
        if self.decoder_stack is None:
            return
        layers = []
        for layer in self.layers:
            projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj)
            if any(p.lora is None for p in projections):
                return
            layers.append([[LoRAPart(a, b_t, ranks, start) for (start, _), a, b_t, ranks
                            in zip(p.lora.parts, p.lora.lora_a, p.lora.lora_b_t, p.lora.ranks)]
                           for p in projections])
        self.decoder_stack.set_lora(layers)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden, residual = self.embed_tokens(input_ids), None
        rotary = self.rotary_emb(positions)  # gathered once, shared by every layer
        token_slots = self.lora_step.token_slots if self.lora_step is not None else None
        done = self.decoder_stack is not None and self.decoder_stack.run(
            hidden, *rotary, kv_caches, attn_metadata, token_slots)
        if done:
            hidden, residual = done
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(rotary, hidden, residual, kv_cache, attn_metadata)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


def _projection(linear: Linear) -> Projection | None:
    quantized = linear.packed_quant
    if quantized is None:
        return None if linear.packed is None else Projection(linear.packed, linear.bias)
    return Projection(quantized[0], linear.bias) if len(quantized) == 1 else None


def _layer_weights(layer: nn.Module) -> LayerWeights | None:
    """A layer's weights for DecoderStack, None where its forward is not the stack's: another
    layer, attention or MLP class, q/k norms, a window or soft cap, tensor parallelism, another
    activation, a quantized projection in several parts."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not (type(layer) is LlamaDecoderLayer and type(attn) is Attention and type(mlp) is GatedMLP
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and layer.post_attention_layernorm.eps == layer.input_layernorm.eps
            and attn.q_norm is None and not attn.attention_kwargs and attn.backend.name == "torch"
            and attn.tp.world_size == 1 and mlp.tp.world_size == 1
            and mlp.act_and_mul is norm_act.silu_and_mul):
        return None
    projections = [_projection(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if None in projections:
        return None
    return LayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *projections)


class LlamaForCausalLM(CausalLM):
    # Our fused projection -> the checkpoint's separate ones, in row order.
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    # Projections whose input columns are split across ranks (their outputs all-reduced).
    ROW_PARALLEL = ("o_proj", "down_proj")
    supports_tensor_parallel = True
    supports_quantized_tensor_parallel = True

    def __init__(self, config, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto", device: torch.device | str = "cpu"):
        super().__init__(config, dtype, attention_backend, device)
        self.model = self.build_model(config)
        self._init_lm_head(self.model.embed_tokens, config.hidden_size)

    def build_model(self, config) -> nn.Module:
        layers = [LlamaDecoderLayer(config, llama_attention(config, i, window, self.attention_backend,
                                                            self.dtype, self.device),
                                    self.build_mlp(config, i), self.dtype, self.device)
                  for i, window in enumerate(self.sliding_windows)]
        return LlamaModel(config, layers, self.dtype, self.device)

    def build_mlp(self, config, layer: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                        self.dtype, self.device, bias=bool(getattr(config, "mlp_bias", False)))

    def checkpoint_sources(self, name: str) -> list[tuple[str, slice | None]]:
        parts = name.split(".")
        fused = parts[-2] if len(parts) >= 2 else None
        if fused not in self.FUSED or self.config.model_type == "phi3":  # Phi-3 stores them fused
            return [(name, None)]
        tp = self.tp.world_size  # our fused parameter holds this rank's rows of each part
        if fused == "qkv_proj":
            q_size = self.num_heads // tp * self.head_dim
            kv_size = self.num_local_kv_heads * self.head_dim
            sizes = [q_size, kv_size, kv_size]
        else:
            sizes = [self.config.intermediate_size // tp] * 2
        prefix = ".".join(parts[:-2])
        return split_rows(sizes, [f"{prefix}.{hf}.{parts[-1]}" for hf in self.FUSED[fused]])

    def checkpoint_shard(self, hf_name: str, name: str) -> Shard | None:
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Shard(0, ((self.vocab_start, self.vocab_stop),))
        if module in self.ROW_PARALLEL:
            size = self.num_heads * self.head_dim if module == "o_proj" else self.config.intermediate_size
            return row_parallel(self.tp, size, module, parts[-1] == "bias")
        if module not in self.FUSED:
            return None  # norms: every rank holds them whole
        hd, rank, tp = self.head_dim, self.tp.rank, self.tp.world_size
        q_start, q_stop = self.tp.split(self.num_heads, "num_attention_heads")
        kv_first = kv_head_start(self.num_kv_heads, tp, rank)
        q = (q_start * hd, q_stop * hd)
        kv = (kv_first * hd, (kv_first + self.num_local_kv_heads) * hd)
        inter = self.config.intermediate_size
        mlp = self.tp.split(inter, "intermediate_size")
        if self.config.model_type == "phi3":  # the checkpoint holds them fused: pick each part
            if module == "qkv_proj":
                q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
                return Shard(0, (q, (q_size + kv[0], q_size + kv[1]),
                                 (q_size + kv_size + kv[0], q_size + kv_size + kv[1])))
            return Shard(0, (mlp, (inter + mlp[0], inter + mlp[1])))
        hf_part = hf_name.split(".")[-2]
        if hf_part == "q_proj":
            return Shard(0, (q,))
        if hf_part in ("k_proj", "v_proj"):
            return Shard(0, (kv,))
        return Shard(0, (mlp,))


__all__ = ["Linear", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaModel", "llama_attention"]
