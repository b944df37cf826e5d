"""Rotary position embedding: frequencies from the HF config, a cos/sin table built once, and the
rotation itself ("rotate half" layout, as HF checkpoints of every rotary family here use), on all
of a head or on its first rotary_dim dims (GPT-NeoX's rotary_pct, Phi's partial_rotary_factor).
"""
from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """rope_theta, rope_type and the scaling fields, from either config generation.

    Newer transformers keep everything under `config.rope_parameters` (per layer type for Gemma 3);
    older ones have `config.rope_theta` and an optional `config.rope_scaling` dict whose type key is
    `rope_type` or the older `type`, and GPT-NeoX's `rotary_pct`.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        params = {"rope_theta": config.rope_local_base_freq}  # Gemma 3 under older transformers
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] in ("su", "yarn") and getattr(config, "model_type", None) == "phi3":
        params["rope_type"] = "longrope"  # Phi-3's early names for it, as transformers reads them
    return params


def rotary_dim(config, head_dim: int, params: dict) -> int:
    """How many of a head's dims rotate."""
    factor = (params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
              or getattr(config, "rotary_pct", None) or 1.0)
    return int(head_dim * factor)


def inverse_frequencies(config, dim: int, params: dict | None = None) -> torch.Tensor:
    """[dim // 2] float32 inverse frequencies for a rotary dim of `dim`, rope scaling applied.

    For longrope these are short_factor's (_longrope_table swaps in long_factor where it applies).
    """
    params = params or rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}: supported are {SUPPORTED_ROPE_TYPES}")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope_type == "longrope":
        return 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base ** exponents)
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_uses_long_factors(params: dict, max_model_len: int) -> bool:
    """Whether a longrope model serving sequences up to max_model_len rotates with long_factor.

    transformers picks the factor set per forward, for every position at once, from the length of
    the sequence: long once it exceeds original_max_position_embeddings, and `generate` drops its
    cache at that point to recompute the whole sequence. A token's keys therefore depend on the
    length of the sequence they end up in, not only on their prefix, which a paged KV cache shared
    through prefix hashes cannot honour without recomputing every crossing sequence. So, as vLLM
    does, the set is chosen once from max_model_len: a sequence then matches transformers whenever
    its own length is on the same side of the threshold as max_model_len.
    """
    return max_model_len > params["original_max_position_embeddings"]


def _longrope_table(config, dim: int, params: dict, positions: torch.Tensor,
                    use_long: bool) -> tuple[torch.Tensor, float]:
    """Angles [positions, dim // 2] and the attention factor applied to cos and sin (Phi-3).

    One factor set for every position; the attention factor is the same for both sets, from
    `factor` or else max_position_embeddings / original_max_position_embeddings, as transformers
    computes it.
    """
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / original
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if use_long:
        params = dict(params, short_factor=params["long_factor"])
    return positions[:, None] * inverse_frequencies(config, dim, params)[None, :], scaling


class RotaryEmbedding(torch.nn.Module):
    """The cos | sin table for every position up to max_positions.

    Computed in float32 exactly as transformers does, then stored in the model dtype; a step
    gathers its rows once and every layer reuses them through apply_rotary. A longrope table
    holds the factor set longrope_uses_long_factors picks for max_model_len (default:
    max_positions); set_max_model_len refills it in place.
    """

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", layer_type: str | None = None,
                 max_model_len: int | None = None):
        super().__init__()
        self.config = config
        self.params = rope_parameters(config, layer_type)
        self.rotary_dim = rotary_dim(config, head_dim, self.params)
        self.max_positions = max_positions
        self.use_long_factors = self._uses_long_factors(max_model_len or max_positions)
        self.register_buffer("cos_sin", self._table().to(dtype=dtype, device=device), persistent=False)

    def _uses_long_factors(self, max_model_len: int) -> bool | None:
        if self.params["rope_type"] != "longrope":
            return None
        return longrope_uses_long_factors(self.params, max_model_len)

    def _table(self) -> torch.Tensor:
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        if self.use_long_factors is not None:
            freqs, scaling = _longrope_table(self.config, self.rotary_dim, self.params, positions,
                                             self.use_long_factors)
        else:
            freqs = positions[:, None] * inverse_frequencies(self.config, self.rotary_dim, self.params)[None, :]
            scaling = 1.0
        return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)

    def set_max_model_len(self, max_model_len: int) -> None:
        """Refill the table (same buffer) if the longest served sequence changes the factor set."""
        use_long = self._uses_long_factors(max_model_len)
        if use_long != self.use_long_factors:
            self.use_long_factors = use_long
            self.cos_sin.copy_(self._table())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> (cos, sin), each [num_tokens, 1, rotary_dim // 2]."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin
