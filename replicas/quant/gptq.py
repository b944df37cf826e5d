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

from kernels.quantized import QuantWeight
from replicas.quant.module_pieces import (act_order, checked_groups, gather, quant_weight,
                                          suffix_piece, unpack_int32)

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


def gptq_tensors(quantization_config: dict, named_tensors: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    scheme = GPTQScheme(quantization_config)
    return gather(named_tensors, suffix_piece(PIECES), scheme.required, scheme.build)
