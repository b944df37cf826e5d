"""compressed-tensors checkpoints (what llm-compressor writes; quant_method "compressed-tensors")
with integer weight-only schemes (W4A16, W8A16) -> QuantWeight.

"pack-quantized": `weight_packed` int32 [n, k * bits / 32] (packed along k, value j in bits
[(j * bits) % 32, ...) of word j * bits // 32, stored as q + 2**(bits - 1) for signed q),
`weight_scale` [n, groups] (channel: [n, 1]; tensor: one value), `weight_shape` [2], and for
asymmetric schemes `weight_zero_point` packed the same way along n ([n * bits / 32, groups]);
`weight_g_idx` [k] where activation ordering by group was used. "naive-quantized" /
"int-quantized": the signed values as an int8 `weight` [n, k], zero points unpacked.
W = (q - zero_point) * scale per group, i.e. scale * u - scale * (zero_point + 2**(bits - 1))
with u = q + 2**(bits - 1) unsigned: the packed bytes are already QuantWeight's storage.
"""
from __future__ import annotations

import re
import sys
from typing import Iterable, Iterator

import torch

from pagedserve.kernels.quantized import QuantWeight, pack_values
from pagedserve.replicas.quant.module_pieces import act_order, gather, read, read_ranges, shape_of

PACKED, NAIVE = "pack-quantized", ("naive-quantized", "int-quantized")
FORMATS = (PACKED, *NAIVE)
BITS = (4, 8)
STRATEGIES = ("group", "channel", "tensor")
GROUP_ACT_ORDERS = ("group", "dynamic")
PIECES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


class Scheme:
    """One config group's weight quantization, checked."""

    def __init__(self, name: str, group: dict, default_format: str | None):
        self.targets = list(group.get("targets") or [])
        self.format = group.get("format") or default_format
        weights = group.get("weights") or {}
        self.bits = int(weights.get("num_bits", 0))
        self.symmetric = bool(weights.get("symmetric", True))
        self.strategy = weights.get("strategy")
        self.group_size = weights.get("group_size")
        self.act_order = weights.get("actorder")
        problems = []
        if self.format not in FORMATS:
            problems.append(f"format {self.format!r} (supported: {', '.join(FORMATS)})")
        if weights.get("type", "int") != "int":
            problems.append(f"weight type {weights.get('type')!r} (supported: int)")
        if self.bits not in BITS:
            problems.append(f"{self.bits}-bit weights (supported: {', '.join(map(str, BITS))})")
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy {self.strategy!r} (supported: {', '.join(STRATEGIES)})")
        if weights.get("dynamic"):
            problems.append("dynamic weight quantization")
        for kind in ("input_activations", "output_activations"):
            if group.get(kind):
                problems.append(f"{kind.replace('_', ' ')} quantization (only weight-only W4A16 / "
                                "W8A16 schemes are supported)")
        if problems:
            raise ValueError(f"compressed-tensors scheme {name!r} is not supported: {'; '.join(problems)}")

    def required(self) -> set[str]:
        pieces = {"weight_scale"} | ({"weight_packed", "weight_shape"} if self.format == PACKED else {"weight"})
        if not self.symmetric:
            pieces.add("weight_zero_point")
        if self.act_order in GROUP_ACT_ORDERS:
            pieces.add("weight_g_idx")
        return pieces

    def matches(self, module: str) -> int:
        """How specifically a target names the module: 3 by name, 2 by regex, 1 by type, 0 not."""
        best = 0
        for target in self.targets:
            if target.startswith("re:"):
                if re.match(target[3:], module):
                    best = max(best, 2)
            elif target == module or module.endswith("." + target):
                best = 3
            elif target == "Linear" or target.endswith("Linear"):
                best = max(best, 1)
        return best


class CompressedTensorsConfig:
    def __init__(self, config: dict):
        if config.get("sparsity_config"):
            raise ValueError("compressed-tensors sparsity (sparsity_config) is not supported")
        if config.get("transform_config"):
            raise ValueError("compressed-tensors transforms (transform_config) are not supported")
        if config.get("kv_cache_scheme"):
            raise ValueError("compressed-tensors KV-cache quantization (kv_cache_scheme) is not supported")
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors quantization_status {status!r} is not supported: "
                             "only compressed checkpoints are")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        self.schemes = [Scheme(name, group, config.get("format")) for name, group in groups.items()]
        if sys.byteorder != "little":
            raise ValueError("compressed-tensors packing is read on little-endian hosts only")
        self._cache: dict[str, Scheme] = {}

    def scheme(self, module: str) -> Scheme:
        if module not in self._cache:
            ranked = sorted(self.schemes, key=lambda s: s.matches(module), reverse=True)
            if ranked[0].matches(module) == 0:
                raise ValueError(f"{module}: quantized tensors that no compressed-tensors config "
                                 "group targets")
            self._cache[module] = ranked[0]
        return self._cache[module]

    def piece_of(self, name: str, tensor: torch.Tensor):
        module, _, piece = name.rpartition(".")
        if not module:
            return None
        is_int8 = tensor.dtype == torch.int8 if isinstance(tensor, torch.Tensor) else tensor.get_dtype() == "I8"
        if piece in PIECES or (piece == "weight" and is_int8):
            return module, piece
        return None

    def shard_pieces(self, module: str, parts: dict, shard) -> dict[str, torch.Tensor] | None:
        """A rank's part, read from the lazy pieces: output rows are rows of the values and the
        scales (the zero points' packed words), input columns the values' words and whole groups
        (a per-channel or per-tensor scale stays whole); with act-order, columns are cut after
        building."""
        scheme = self.scheme(module)
        per_word = 32 // scheme.bits
        packed = scheme.format == PACKED
        values_name = "weight_packed" if packed else "weight"
        if packed:
            n, k = (int(v) for v in read(parts["weight_shape"]).flatten().tolist())
        else:
            n, k = shape_of(parts["weight"])
        scale_shape = shape_of(parts["weight_scale"])
        groups = scale_shape[-1] if len(scale_shape) == 2 else 1
        pieces = {}
        if "weight_g_idx" in parts:
            pieces["weight_g_idx"] = read(parts["weight_g_idx"])
        if shard.dim == 0:
            rows = sum(stop - start for start, stop in shard.ranges)
            pieces[values_name] = read_ranges(parts[values_name], 0, shard.ranges)
            per_row = len(scale_shape) == 2 and scale_shape[0] == n
            pieces["weight_scale"] = (read_ranges(parts["weight_scale"], 0, shard.ranges) if per_row
                                      else read(parts["weight_scale"]))
            if "weight_zero_point" in parts:
                zero = parts["weight_zero_point"]
                pieces["weight_zero_point"] = (
                    read_ranges(zero, 0, shard.ranges, per_word) if packed
                    else read_ranges(zero, 0, shard.ranges) if per_row and shape_of(zero)[0] == n
                    else read(zero))
            if packed:
                pieces["weight_shape"] = torch.tensor([rows, k])
            return None if any(piece is None for piece in pieces.values()) else pieces
        (start, stop), = shard.ranges
        if "weight_g_idx" in pieces and act_order(pieces["weight_g_idx"], k, k // groups, module) is not None:
            return None
        group = k // groups
        if groups > 1 and (start % group or stop % group):
            return None
        if packed:
            if (start * scheme.bits) % 32 or ((stop * scheme.bits) % 32 and stop != k):
                return None
            words = (start * scheme.bits // 32, -(-stop * scheme.bits // 32))
            pieces[values_name] = read(parts[values_name], (slice(None), slice(*words)))
            pieces["weight_shape"] = torch.tensor([n, stop - start])
        else:
            pieces[values_name] = read(parts[values_name], (slice(None), slice(start, stop)))
        for name in ("weight_scale", "weight_zero_point"):
            if name in parts:
                pieces[name] = (read_ranges(parts[name], 1, shard.ranges, group) if groups > 1
                                else read(parts[name]))
        if "weight_g_idx" in pieces:
            pieces["weight_g_idx"] = pieces["weight_g_idx"][start:stop] - start // group
        return pieces

    def build(self, module: str, parts: dict[str, torch.Tensor]) -> QuantWeight:
        scheme = self.scheme(module)
        bits, half = scheme.bits, 2 ** (scheme.bits - 1)
        if scheme.format == PACKED:
            n, k = (int(v) for v in parts["weight_shape"].flatten().tolist())
            packed = parts["weight_packed"]
            if packed.dtype != torch.int32 or packed.shape != (n, -(-k * bits // 32)):
                raise ValueError(f"{module}: weight_packed {packed.dtype} {list(packed.shape)} does not "
                                 f"hold a [{n}, {k}] {bits}-bit weight")
            stored = packed.contiguous().view(torch.uint8)[:, :k * bits // 8]  # u = q + half
            values = stored if bits == 8 else torch.stack((stored & 0xF, stored >> 4), -1).flatten(1)
        else:
            weight = parts["weight"]
            n, k = weight.shape
            values = (weight.to(torch.int16) + half).to(torch.uint8)
        scale = parts["weight_scale"].float().reshape(-1, parts["weight_scale"].shape[-1]) \
            if parts["weight_scale"].dim() else parts["weight_scale"].float().view(1, 1)
        scale = scale.expand(n, -1) if scale.shape[0] == 1 else scale
        groups = scale.shape[1]
        if scale.shape[0] != n or k % groups:
            raise ValueError(f"{module}: weight_scale {list(parts['weight_scale'].shape)} does not fit "
                             f"a [{n}, {k}] weight")
        group_size = k // groups
        zero = parts.get("weight_zero_point")
        if zero is None:
            stored_zero = torch.full((n, groups), float(half))
        elif scheme.format == PACKED:
            stored_zero = unpack_zero_points(zero, bits, n, groups).float()
        else:
            stored_zero = zero.float().reshape(-1, groups).expand(n, -1) + half
        perm = act_order(parts.get("weight_g_idx"), k, group_size, module)
        if perm is not None:
            values = values[:, perm]
        scale = scale.contiguous()
        return QuantWeight(bits, group_size, pack_values(values, bits), scale,
                           (-stored_zero * scale).contiguous(), perm)


def unpack_zero_points(packed: torch.Tensor, bits: int, n: int, groups: int) -> torch.Tensor:
    """Zero points packed along n ([n * bits / 32, groups] int32) -> their stored (unsigned)
    values [n, groups]."""
    words = packed.t().contiguous().view(torch.uint8)  # [groups, bytes along n]
    values = words if bits == 8 else torch.stack((words & 0xF, words >> 4), -1).flatten(1)
    return values[:, :n].t()


def compressed_tensors_tensors(quantization_config: dict,
                               named_tensors: Iterable[tuple[str, torch.Tensor]], lazy: bool = False
                               ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    config = CompressedTensorsConfig(quantization_config)
    return gather(named_tensors, config.piece_of, lambda module: config.scheme(module).required(),
                  config.build, config.shard_pieces if lazy else None)
