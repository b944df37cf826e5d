"""GGML's quantized block layouts -> QuantWeight, a whole tensor at a time.

Each function takes a weight's raw bytes as uint8 [n, blocks per row * block bytes] and returns
the same values as a QuantWeight (kernels/quantized.py), exactly as ggml dequantizes them
(gguf.quants is the reference the tests compare with): a signed format's zero is folded into
the offset, and K-quants' two-level scales are multiplied out into one float32 scale and offset
per sub-block. 5- and 6-bit values are stored one per byte (bits 8).
"""
from __future__ import annotations

import torch

from pagedserve.kernels.quantized import QuantWeight, pack_values


def _split(raw: torch.Tensor, block_bytes: int, *sizes: int) -> list[torch.Tensor]:
    """[n, nb * block_bytes] -> the named byte fields of every block, each [n, nb, size]."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, block_bytes)
    fields, start = [], 0
    for size in sizes:
        fields.append(blocks[..., start:start + size])
        start += size
    return fields


def _half(field: torch.Tensor) -> torch.Tensor:
    """A 2-byte field [n, nb, 2] -> its float16 value as float32 [n, nb]."""
    return field.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles_split(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0/Q4_1/Q5 byte layout: value j in the low nibble of byte j, value j + half in its high
    nibble -> values [..., 2 * bytes] in order."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def _bits(field: torch.Tensor) -> torch.Tensor:
    """Bytes [..., m] -> their bits [..., 8 m], bit b of the little-endian word at position b."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((field.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _weight(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int) -> QuantWeight:
    """values [n, groups, group] (unsigned), scales / offsets [n, groups] -> a QuantWeight."""
    n, groups, group = values.shape
    return QuantWeight(bits, group, pack_values(values.reshape(n, groups * group), bits),
                       scales.contiguous(), offsets.contiguous())


def q8_0(raw: torch.Tensor) -> QuantWeight:
    d, qs = _split(raw, 34, 2, 32)
    d = _half(d)
    return _weight(qs ^ 0x80, d, -128 * d, 8)  # int8 q -> q + 128 by flipping the sign bit


def q4_0(raw: torch.Tensor) -> QuantWeight:
    d, qs = _split(raw, 18, 2, 16)
    d = _half(d)
    return _weight(_nibbles_split(qs), d, -8 * d, 4)


def q4_1(raw: torch.Tensor) -> QuantWeight:
    d, m, qs = _split(raw, 20, 2, 2, 16)
    return _weight(_nibbles_split(qs), _half(d), _half(m), 4)


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _nibbles_split(qs) | (_bits(qh) << 4)


def q5_0(raw: torch.Tensor) -> QuantWeight:
    d, qh, qs = _split(raw, 22, 2, 4, 16)
    d = _half(d)
    return _weight(_q5_values(qh, qs), d, -16 * d, 8)


def q5_1(raw: torch.Tensor) -> QuantWeight:
    d, m, qh, qs = _split(raw, 24, 2, 2, 4, 16)
    return _weight(_q5_values(qh, qs), _half(d), _half(m), 8)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> (sc, m), each [n, nb, 8]."""
    low, high, rest = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((low & 0x3F, (rest & 0xF) | ((low >> 2) & 0x30)), dim=-1)
    mins = torch.cat((high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)), dim=-1)
    return sc.float(), mins.float()


def _k_weight(values: torch.Tensor, d, dmin, scales, bits: int) -> QuantWeight:
    """values [n, nb, 8, 32] of a Q4_K/Q5_K tensor -> groups of 32 with scale d * sc and offset
    -dmin * m (ggml computes the same two products)."""
    n, nb = values.shape[:2]
    sc, mins = _k_scales(scales)
    scale = (_half(d).unsqueeze(-1) * sc).reshape(n, nb * 8)
    offset = -(_half(dmin).unsqueeze(-1) * mins).reshape(n, nb * 8)
    return _weight(values.reshape(n, nb * 8, 32), scale, offset, bits)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """K-quant nibbles: each 32 bytes hold sub-block 2c (low nibbles) and 2c + 1 (high ones)."""
    n, nb = qs.shape[:2]
    qs = qs.reshape(n, nb, 4, 1, 32)
    return torch.cat((qs & 0xF, qs >> 4), dim=3).reshape(n, nb, 8, 32)


def q4_k(raw: torch.Tensor) -> QuantWeight:
    d, dmin, scales, qs = _split(raw, 144, 2, 2, 12, 128)
    return _k_weight(_k_nibbles(qs), d, dmin, scales, 4)


def q5_k(raw: torch.Tensor) -> QuantWeight:
    d, dmin, scales, qh, qs = _split(raw, 176, 2, 2, 12, 32, 128)
    shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
    high = (qh.unsqueeze(-2) >> shifts) & 1  # [n, nb, 8, 32]: bit s of qh[l] for sub-block s
    return _k_weight(_k_nibbles(qs) | (high << 4), d, dmin, scales, 8)


def q6_k(raw: torch.Tensor) -> QuantWeight:
    ql, qh, scales, d = _split(raw, 210, 128, 64, 16, 2)
    n, nb = ql.shape[:2]
    low = ql.reshape(n, nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    low = (low & 0xF).reshape(n, nb, 8, 32)
    high = qh.reshape(n, nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    high = (high & 3).reshape(n, nb, 8, 32)
    values = (low | (high << 4)).reshape(n, nb * 16, 16)  # q + 32, 16 values per scale
    scale = (_half(d).unsqueeze(-1) * scales.contiguous().view(torch.int8).float()).reshape(n, nb * 16)
    return _weight(values, scale, -32 * scale, 8)


# GGML type name -> converter. Dense types (F32, F16, BF16) are read as tensors elsewhere.
QUANTIZED = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1,
             "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED_TYPES = tuple(DENSE) + tuple(QUANTIZED)
