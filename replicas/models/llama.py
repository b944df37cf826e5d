"""One torch decoder for the Llama family: Llama, Mistral (without a sliding window) and Qwen2.

Differences are config fields: grouped-query attention, an explicit head_dim, q/k/v biases (Qwen2),
rope scaling, tied embeddings. q/k/v and gate/up are fused into one matmul each at load time.
Attention goes through a paged-attention backend: every layer stores the step's K/V into the
paged cache first, then attends over the cache, so all sequences of a packed batch are handled by
one call per layer and no Python loop runs per token.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear, norm_act
from kernels.backend import AttentionBackend, get_attention_backend
from kernels.metadata import AttentionMetadata, kv_cache_shape
from replicas.models.rotary import RotaryEmbedding, apply_rotary


def _weight(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.weight = _weight(out_features, in_features, dtype=dtype, device=device)
        self.bias = _weight(out_features, dtype=dtype, device=device) if bias else None
        self.packed: cpu_linear.PackedWeight | None = None  # set by pack(), after loading

    def pack(self) -> None:
        self.packed = cpu_linear.pack(self.weight)
        if self.packed is not None and self.packed.replaces_weight:  # keep one copy in memory
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.packed, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = _weight(num_embeddings, embedding_dim, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config) -> int | None:
    """The attention window a checkpoint was trained with, or None when attention is full."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the model dtype, like the HF reference.

    norm(x) -> y; norm(x, residual) -> (norm(x + residual), x + residual), fused on CPU.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.weight = _weight(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return norm_act.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        is_qwen2 = config.model_type == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_size, is_qwen2 or attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, attention_bias and not is_qwen2,
                             dtype, device)
        self.backend = backend

    def forward(self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k sit side by side in the fused output: rotate them in one call.
        num_qk_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, num_qk_heads, self.head_dim)
        qk = apply_rotary(qk, *rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.store_kv(k, v, kv_cache, attn_metadata.slot_mapping)
        out = self.backend.paged_attention(q, kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype, device):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only silu")
        self.intermediate_size = config.intermediate_size
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, mlp_bias, dtype, device)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(norm_act.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)
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
    def __init__(self, config, backend: AttentionBackend, dtype: torch.dtype, device):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings,
                                          dtype, device)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden, residual = self.embed_tokens(input_ids), None
        rotary = self.rotary_emb(positions)  # gathered once, shared by every layer
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rotary, hidden, residual, kv_cache, attn_metadata)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The decoder the model runner drives.

    model(input_ids [T], positions [T], kv_caches, attn_metadata) -> final hidden states [T, hidden]
    for all tokens of the step packed together; compute_logits(rows) -> float32 logits.
    kv_caches holds one tensor per layer, shaped [2, num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(self, config, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto",
                 device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        if isinstance(attention_backend, str):
            attention_backend = get_attention_backend(attention_backend, device)
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.config = config
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        window = sliding_window_of(config)
        # Sequences no longer than the window attend exactly as in training; beyond it they would not.
        self.max_context_len = min(config.max_position_embeddings, window or config.max_position_embeddings)
        self.model = LlamaModel(config, attention_backend, dtype, device)
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        self.tied_lm_head_packed: cpu_linear.PackedWeight | None = None

    def pack_weights(self) -> None:
        """After loading, on CPU: every projection (and a tied lm_head) gets its packed weight."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.tie_word_embeddings:  # the embedding keeps its rows for lookups
            self.tied_lm_head_packed = cpu_linear.pack(self.lm_head.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        if self.tie_word_embeddings:
            return cpu_linear.linear(hidden, self.lm_head.weight, self.tied_lm_head_packed).float()
        return self.lm_head(hidden).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""
        return kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)

    # HF projection -> (our fused projection, index of its rows in it)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, casting to the model dtype; fails on missing or unknown names."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:  # a buffer some old checkpoints saved
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied checkpoints may still carry a copy of the embedding
            name, rows = self._target(hf_name)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
            param = params[name]
            target = param.data if rows is None else param.data[rows]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(hf_name)
        expected = self._expected_hf_names(params)
        missing = sorted(expected - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")

    def _target(self, hf_name: str) -> tuple[str, slice | None]:
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in self._FUSED:
            fused, shard = self._FUSED[parts[-2]]
            name = ".".join(parts[:-2] + [fused, parts[-1]])
            return name, self._shard_rows(fused, shard)
        return hf_name, None

    def _shard_rows(self, fused: str, shard: int) -> slice:
        if fused == "qkv_proj":
            q_size = self.config.num_attention_heads * self.head_dim
            kv_size = self.num_kv_heads * self.head_dim
            starts = (0, q_size, q_size + kv_size)
            sizes = (q_size, kv_size, kv_size)
        else:
            size = self.config.intermediate_size
            starts, sizes = (0, size), (size, size)
        return slice(starts[shard], starts[shard] + sizes[shard])

    def _expected_hf_names(self, params: dict[str, nn.Parameter]) -> set[str]:
        unfused = {fused: [hf for hf, (f, _) in self._FUSED.items() if f == fused]
                   for fused in ("qkv_proj", "gate_up_proj")}
        names = set()
        for name in params:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in unfused:
                names.update(".".join(parts[:-2] + [hf, parts[-1]]) for hf in unfused[parts[-2]])
            else:
                names.add(name)
        return names
