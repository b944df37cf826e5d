"""Self-attention over the paged KV cache, shared by every family: one fused q|k|v projection,
optional per-head q/k RMSNorm (Qwen3, Gemma 3), rotary on all or part of each head, then the
step's K/V go into the cache and one backend call attends over it for the whole packed batch.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.backend import AttentionBackend
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.replicas.models.layers import Linear, RMSNorm
from pagedserve.kernels.rotary import apply_rotary
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.parallel.sharding import kv_heads_per_rank


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (HF semantics: position i sees keys j with i - window < j <= i),
    None for full attention: Mistral/Phi-3 `sliding_window` on every layer, Qwen2/3's
    `use_sliding_window` from `max_window_layers` up, Gemma's `layer_types` (or, in older configs,
    every other layer for Gemma 2 and `sliding_window_pattern` for Gemma 3).
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        model_type = getattr(config, "model_type", "")
        if model_type == "gemma2":
            layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        elif model_type.startswith("gemma3"):
            pattern = getattr(config, "sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(num_layers)]
        elif getattr(config, "max_window_layers", None) is not None and model_type.startswith("qwen"):
            layer_types = ["sliding_attention" if i >= config.max_window_layers else "full_attention"
                           for i in range(num_layers)]
        else:
            return [int(window)] * num_layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


class Attention(nn.Module):
    """hidden [T, hidden] -> attention output [T, hidden] for the step's packed tokens.

    q|k|v come from one fused projection (its rows: all q heads, then k heads, then v heads);
    sliding_window and logits_soft_cap are handed to the backend only where set. Under tensor
    parallelism the heads are this rank's (its q heads and their KV heads, replicated where there
    are fewer KV heads than ranks), and o_proj's partial sums are all-reduced.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend, dtype: torch.dtype, device, qkv_bias: bool = False,
                 o_bias: bool = False, scale: float | None = None, qk_norm_eps: float | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.tp = parallel_state.current()
        num_heads //= self.tp.world_size
        num_kv_heads = kv_heads_per_rank(num_kv_heads, self.tp.world_size)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, dtype, device)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype, device)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype, device)
        self.backend = backend
        self.attention_kwargs = {}
        if sliding_window is not None:
            self.attention_kwargs["sliding_window"] = sliding_window
        if logits_soft_cap is not None:
            self.attention_kwargs["logits_soft_cap"] = logits_soft_cap

    def forward(self, rotary: tuple[torch.Tensor, torch.Tensor] | None, hidden: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if rotary is not None and self.q_norm is None:  # one call rotates and stores K and V
            q = self.backend.rotary_store_kv(qkv, *rotary, kv_cache, attn_metadata.slot_mapping,
                                             self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            q = self._rotate_and_store(rotary, qkv, kv_cache, attn_metadata)
        out = self.backend.paged_attention(q, kv_cache, attn_metadata, self.scale, **self.attention_kwargs)
        out = self.o_proj(out.reshape(num_tokens, self.q_size))
        return out if self.tp.world_size == 1 else self.tp.all_reduce(out)

    def _rotate_and_store(self, rotary, qkv: torch.Tensor, kv_cache: torch.Tensor,
                          attn_metadata: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, head_dim], with Qwen3's q/k norms before the rotation, or no rotation."""
        num_tokens = qkv.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, num_qk_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
            qk = torch.cat((q, k), dim=1)
        if rotary is not None:  # q and k side by side: rotate them in one call
            qk = apply_rotary(qk, *rotary)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.store_kv(k, v, kv_cache, attn_metadata.slot_mapping)
        return q
