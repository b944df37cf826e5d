"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum: quant_method "gptq") -> QuantWeight.

Per quantized linear [n out, k in]: `qweight` int32 [k * bits / 32, n] (values packed along k,
value i of a word in bits [i * bits, (i + 1) * bits)), `qzeros` int32 [groups, n * bits / 32]
(packed along n), `scales` float16 [groups, n], `g_idx` int32 [k] (the group of each input
channel: act-order, desc_act, makes it a permutation). W[:, i] = (q - z) * s of group g_idx[i].

checkpoint_format "gptq" (v1, what AutoGPTQ and transformers write, and the default) stores
z - 1; "gptq_v2" stores z. v1 zeros are read as stored + 1 without wrapping, as vLLM's and
exllama's kernels do (a v1 checkpoint cannot hold z = 0: AutoGPTQ's packing overflows on it).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from pagedserve.kernels.quantized import QuantWeight
from pagedserve.replicas.quant.module_pieces import (
    act_order, checked_groups, gather, quant_weight, read, read_ranges, shape_of, suffix_piece,
    unpack_int32,
)

BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
PIECES = ("qweight", "qzeros", "scales", "g_idx")


class GPTQScheme:
    """The checked quantization_config of a GPTQ checkpoint."""

    def __init__(self, config: dict):
        self.bits = int(config.get("bits", 4))
        if self.bits not in BITS:
            raise ValueError(f"GPTQ with {self.bits} bits is not supported: supported bits are "
                             f"{', '.join(map(str, BITS))}")
        self.group_size = int(config.get("group_size", 128))
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"GPTQ group_size {self.group_size} is not supported: use -1 or a "
                             "positive size")
        self.checkpoint_format = config.get("checkpoint_format") or "gptq"
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {self.checkpoint_format!r} is not supported: "
                             f"supported are {', '.join(CHECKPOINT_FORMATS)}")
        self.desc_act = bool(config.get("desc_act", False))
        if config.get("dynamic"):
            raise ValueError("GPTQ per-module overrides (dynamic) are not supported")

    def required(self, module: str) -> set[str]:
        # Without act-order, g_idx (when saved) is i // group_size: nothing to wait for.
        return {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.desc_act else set())

    def build(self, module: str, parts: dict[str, torch.Tensor]) -> QuantWeight:
        bits = self.bits
        values = unpack_int32(parts["qweight"], bits, dim=0)  # [k, n]
        k, n = values.shape
        scales = parts["scales"]
        zeros = unpack_int32(parts["qzeros"], bits, dim=1)[:, :n].float()
        group_size = checked_groups("GPTQ", module, k, n, self.group_size, scales, zeros)
        if self.checkpoint_format == "gptq":
            zeros = zeros + 1
        perm = act_order(parts.get("g_idx"), k, group_size, module)
        return quant_weight(values, scales, zeros, bits, group_size, perm)


    def shard_pieces(self, module: str, parts: dict, shard) -> dict[str, torch.Tensor] | None:
        """A rank's part, read from the lazy pieces: output rows are qweight's and scales' columns
        (qzeros' words); input columns qweight's rows (channel order, act-order or not) and,
        without act-order, whole groups of scales and qzeros."""
        per_word = 32 // self.bits
        g_idx = read(parts["g_idx"]) if "g_idx" in parts else None
        if shard.dim == 0:
            qzeros = read_ranges(parts["qzeros"], 1, shard.ranges, per_word)
            if qzeros is None:
                return None
            pieces = {"qweight": read_ranges(parts["qweight"], 1, shard.ranges),
                      "scales": read_ranges(parts["scales"], 1, shard.ranges), "qzeros": qzeros}
            return pieces if g_idx is None else pieces | {"g_idx": g_idx}
        (start, stop), = shard.ranges
        k = shape_of(parts["qweight"])[0] * per_word
        if self.group_size != -1 and g_idx is not None and \
                act_order(g_idx, k, self.group_size, module) is not None:
            return None  # the rank's channels hold pieces of any group: cut after building
        qweight = read_ranges(parts["qweight"], 0, shard.ranges, per_word)
        if self.group_size == -1:  # one group: the slice keeps it whole
            return None if qweight is None else {"qweight": qweight, "scales": read(parts["scales"]),
                                                 "qzeros": read(parts["qzeros"])}
        scales = read_ranges(parts["scales"], 0, shard.ranges, self.group_size)
        if qweight is None or scales is None:
            return None
        pieces = {"qweight": qweight, "scales": scales,
                  "qzeros": read_ranges(parts["qzeros"], 0, shard.ranges, self.group_size)}
        if g_idx is not None:
            pieces["g_idx"] = g_idx[start:stop] - start // self.group_size
        return pieces


def gptq_tensors(quantization_config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    scheme = GPTQScheme(quantization_config)
    return gather(named_tensors, suffix_piece(PIECES), scheme.required, scheme.build,
                  scheme.shard_pieces if lazy else None)
