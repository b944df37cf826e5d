"""The one in-memory form of a weight-only quantized [n, k] weight, whatever format it came from.

Every checkpoint format (GGUF's Q4_0 ... Q6_K, GPTQ, AWQ, compressed-tensors) is converted at load
into a QuantWeight, and every kernel (kernels/quant_linear.py on CPU, kernels/triton_quant.py on
CUDA) packs a QuantWeight into its own layout. The value of a weight is

    W[i, perm[j]] = scales[i, j // group_size] * q[i, j] + offsets[i, j // group_size]

with q unsigned (0 .. 2**bits - 1): a signed or zero-pointed format folds its zero into the
offset (GPTQ's (q - z) * s is s * q + (-z * s); Q8_0's d * q with q in -128..127 stores q + 128
and offset -128 * d), so one formula and one kernel serve all of them. kernels/reference.py's
dequantize_weight is the spec.

Storage: bits 4 packs two values per byte, value 2c in the low nibble of byte c (value 2c + 1 in
the high one); bits 8 is one byte per value. perm (optional, GPTQ's act-order) names for each
stored column j the input channel it multiplies: y = x[:, perm] . W_stored^T.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (4, 8)


@dataclass(frozen=True)
class QuantWeight:
    bits: int
    group_size: int
    q: torch.Tensor  # uint8 [n, k * bits // 8]
    scales: torch.Tensor  # float32 [n, k // group_size]
    offsets: torch.Tensor  # float32 [n, k // group_size]
    perm: torch.Tensor | None = None  # int64 [k]: stored column -> input channel

    def __post_init__(self):
        n, k = self.shape
        groups = k // self.group_size if self.group_size else 0
        if self.bits not in BITS:
            raise ValueError(f"unsupported bits {self.bits}: supported are {BITS}")
        if self.q.dtype != torch.uint8 or self.q.dim() != 2:
            raise ValueError(f"q must be a 2-D uint8 tensor, got {self.q.dtype} {list(self.q.shape)}")
        if self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide k = {k}")
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t.dtype != torch.float32 or tuple(t.shape) != (n, groups):
                raise ValueError(f"{name} must be float32 [{n}, {groups}], got {t.dtype} {list(t.shape)}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"perm must have shape [{k}], got {list(self.perm.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features n, in_features k)."""
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets))

    def values(self) -> torch.Tensor:
        """The stored q as uint8 [n, k], one value per byte."""
        if self.bits == 8:
            return self.q
        return torch.stack((self.q & 0xF, self.q >> 4), dim=-1).flatten(1)

    def rows(self, rows: slice | torch.Tensor) -> "QuantWeight":
        """The weight of some output rows (a tensor-parallel shard, an embedding lookup)."""
        return QuantWeight(self.bits, self.group_size, self.q[rows], self.scales[rows],
                           self.offsets[rows], self.perm)

    def columns(self, start: int, stop: int) -> "QuantWeight":
        """The weight of input channels [start, stop) (a row-parallel shard), exactly, renumbered
        from 0: with perm, the stored columns whose channel lies in the range, in stored order.
        Whole groups keep their group size; a group the range cuts (or, with perm, keeps only some
        columns of) keeps its scale and offset for the columns kept, so the result's group size
        is the largest that divides every kept piece of a group (the pieces' gcd)."""
        n, k = self.shape
        if not 0 <= start < stop <= k:
            raise ValueError(f"columns [{start}, {stop}) are not inside a weight of {k} input channels")
        size, bits = self.group_size, self.bits
        if self.perm is None and start % size == 0 and stop % size == 0:
            per_byte = 8 // bits
            return QuantWeight(bits, size, self.q[:, start // per_byte:stop // per_byte].clone(),
                               self.scales[:, start // size:stop // size].clone(),
                               self.offsets[:, start // size:stop // size].clone())
        if self.perm is None:
            kept, channels = torch.arange(start, stop), None
        else:
            kept = ((self.perm >= start) & (self.perm < stop)).nonzero().flatten()
            channels = self.perm[kept] - start
        groups, counts = torch.unique_consecutive(kept // size, return_counts=True)
        new_size = math.gcd(*counts.tolist())
        group_of = groups.repeat_interleave(counts // new_size)  # new group -> the group it came from
        if bits == 4 and (stop - start) % 2:  # an odd count of values does not fill whole bytes
            bits = 8
        perm = None if channels is None or torch.equal(channels, torch.arange(stop - start)) else channels
        return QuantWeight(bits, new_size, pack_values(self.values()[:, kept], bits),
                           self.scales[:, group_of].contiguous(), self.offsets[:, group_of].contiguous(),
                           perm)

    def clone(self) -> "QuantWeight":
        """A copy holding its own storage (a shard that views a whole tensor would keep it alive)."""
        return QuantWeight(self.bits, self.group_size, self.q.clone(), self.scales.clone(),
                           self.offsets.clone(), None if self.perm is None else self.perm.clone())

    def as_format(self, bits: int, group_size: int) -> "QuantWeight":
        """The same values with more bits or smaller groups (both lossless): what lets weights of
        different formats share one fused projection."""
        if bits < self.bits or self.group_size % group_size:
            raise ValueError(f"cannot convert {self.bits}-bit groups of {self.group_size} to "
                             f"{bits}-bit groups of {group_size} without loss")
        repeat = self.group_size // group_size
        q = self.values() if bits == 8 and self.bits == 4 else self.q
        return QuantWeight(bits, group_size, q.contiguous(),
                           self.scales.repeat_interleave(repeat, dim=1),
                           self.offsets.repeat_interleave(repeat, dim=1), self.perm)


def pack_values(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [n, k] values (each < 2**bits) -> QuantWeight.q's storage."""
    values = values.to(torch.uint8)
    if bits == 8:
        return values.contiguous()
    return (values[:, 0::2] | (values[:, 1::2] << 4)).contiguous()


def share_input_order(parts: list[QuantWeight]) -> bool:
    """Whether the weights' stored columns are the same input channels (equal act-order perms)."""
    first = parts[0].perm
    return all((p.perm is None) == (first is None) and (first is None or torch.equal(p.perm, first))
               for p in parts[1:])


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Weights stacked along n (a fused q|k|v or gate|up), in the widest bits and smallest group
    any part has; they must share the input-channel order."""
    bits = max(p.bits for p in parts)
    group = min(p.group_size for p in parts)
    if not share_input_order(parts):
        raise ValueError("fused projections must share one input-channel order (act-order g_idx)")
    perm = parts[0].perm
    parts = [p if (p.bits, p.group_size) == (bits, group) else p.as_format(bits, group) for p in parts]
    return QuantWeight(bits, group, torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                       torch.cat([p.offsets for p in parts]), perm)
