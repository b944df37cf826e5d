"""AWQ checkpoints (AutoAWQ's GEMM layout: quant_method "awq", version "gemm") -> QuantWeight.

Per quantized linear [n out, k in]: `qweight` int32 [k, n / 8] and `qzeros` int32 [groups, n / 8],
both packed along n with AWQ's interleaved order (the 4-bit value in bits [4 i, 4 i + 4) of a
word is column 8 w + AWQ_ORDER[i]), and `scales` float16 [groups, n]; W = (q - z) * s.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pagedserve.kernels.quantized import QuantWeight
from pagedserve.replicas.quant.module_pieces import (
    checked_groups, gather, quant_weight, read_ranges, shape_of, suffix_piece, unpack_int32,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
VERSIONS = ("gemm",)
BITS = (4,)
PIECES = ("qweight", "qzeros", "scales")


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AWQ's order -> uint8 values [rows, cols] in column order."""
    values = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return values[..., list(torch.argsort(torch.tensor(AWQ_ORDER)))].reshape(packed.shape[0], -1)


class AWQScheme:
    def __init__(self, config: dict):
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        version = str(config.get("version", "gemm")).lower()
        if self.bits not in BITS:
            raise ValueError(f"AWQ with {self.bits} bits is not supported: supported bits are "
                             f"{', '.join(map(str, BITS))}")
        if version not in VERSIONS:
            raise ValueError(f"AWQ version {version!r} is not supported: supported versions are "
                             f"{', '.join(VERSIONS)}")
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point false) is not supported")

    def required(self, module: str) -> set[str]:
        return set(PIECES)

    def build(self, module: str, parts: dict[str, torch.Tensor]) -> QuantWeight:
        values = unpack_awq(parts["qweight"])  # [k, n]
        k, n = values.shape
        scales = parts["scales"]
        zeros = unpack_awq(parts["qzeros"])[:, :n]
        group_size = checked_groups("AWQ", module, k, n, self.group_size, scales, zeros)
        return quant_weight(values, scales, zeros, self.bits, group_size, None)


    def shard_pieces(self, module: str, parts: dict, shard) -> dict[str, torch.Tensor] | None:
        """A rank's part, read from the lazy pieces: output rows are columns of all three (8 to a
        word in qweight and qzeros), input columns qweight's rows and whole groups of the others."""
        if shard.dim == 0:
            pieces = {"qweight": read_ranges(parts["qweight"], 1, shard.ranges, 8),
                      "qzeros": read_ranges(parts["qzeros"], 1, shard.ranges, 8),
                      "scales": read_ranges(parts["scales"], 1, shard.ranges)}
        else:
            group = shape_of(parts["qweight"])[0] if self.group_size == -1 else self.group_size
            pieces = {"qweight": read_ranges(parts["qweight"], 0, shard.ranges),
                      "qzeros": read_ranges(parts["qzeros"], 0, shard.ranges, group),
                      "scales": read_ranges(parts["scales"], 0, shard.ranges, group)}
        return None if any(piece is None for piece in pieces.values()) else pieces


def awq_tensors(quantization_config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]],
                lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    scheme = AWQScheme(quantization_config)
    return gather(named_tensors, suffix_piece(PIECES), scheme.required, scheme.build,
                  scheme.shard_pieces if lazy else None)
