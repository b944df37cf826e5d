"""Rotary position embedding: frequencies from the HF config, a cos/sin table built once, and the
rotation itself (the "rotate half" layout HF Llama, Mistral and Qwen2 checkpoints use).
"""
from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config) -> dict:
    """rope_theta, rope_type and the scaling fields, from either config generation.

    transformers 5 keeps everything under `config.rope_parameters`; 4.x has `config.rope_theta` and
    an optional `config.rope_scaling` dict whose type key is `rope_type` or the older `type`.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(config, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, rope scaling applied."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}: supported are {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
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


class RotaryEmbedding(torch.nn.Module):
    """The cos | sin table for every position up to max_positions.

    Computed in float32 exactly as transformers does, then stored in the model dtype; a step
    gathers its rows once and every layer reuses them through apply_rotary.
    """

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__()
        inv_freq = inverse_frequencies(config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)
        self.register_buffer("cos_sin", table, persistent=False)  # [max_positions, head_dim]
        self.max_positions = max_positions

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> (cos, sin), each [num_tokens, 1, head_dim // 2]."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] -> rotated copy (the "rotate half" layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
