"""Gathering a quantized linear's pieces (qweight, scales, zeros, ...) out of a tensor stream.

Checkpoints store each quantized weight as several tensors named `<module>.<piece>`; they arrive
one at a time, in file order, possibly split between shards. A module is converted as soon as
its required pieces are in, so at most a few modules' packed tensors are held at once.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from pagedserve.kernels.quantized import QuantWeight

# (name, tensor) -> (module, piece) when the tensor is a piece of a quantized weight, else None.
PieceOf = Callable[[str, torch.Tensor], "tuple[str, str] | None"]


def suffix_piece(pieces: tuple[str, ...]) -> PieceOf:
    """Pieces recognised by their name's last component."""
    def piece_of(name: str, tensor: torch.Tensor):
        module, _, piece = name.rpartition(".")
        return (module, piece) if module and piece in pieces else None
    return piece_of


# (module, its pieces as lazy slices, a Shard) -> the pieces of the rank's part of the weight
# (which build() turns into that part), or None where the format cannot cut them (read it whole).
ShardPieces = Callable[[str, dict, "object"], "dict[str, torch.Tensor] | None"]


class QuantSource:
    """A quantized module whose pieces are lazy safetensors slices: `read_shard(shard)` reads only
    a tensor-parallel rank's part where shard_pieces can cut it, else the whole weight, then its
    shard (replicas/parallel/sharding.py)."""

    quantized = True

    def __init__(self, module: str, parts: dict, build: Callable, shard_pieces: ShardPieces):
        self.module, self.parts, self.build, self.shard_pieces = module, parts, build, shard_pieces

    def read_shard(self, shard):
        from pagedserve.replicas.parallel.sharding import read_shard
        pieces = None if shard is None or shard.zeros else self.shard_pieces(self.module, self.parts, shard)
        if pieces is not None:
            return self.build(self.module, pieces)
        weight = self.build(self.module, {name: read(piece) for name, piece in self.parts.items()})
        return read_shard(weight, shard)


def read(piece, index: tuple = ()) -> torch.Tensor:
    """A piece (a tensor or a lazy safetensors slice), whole or indexed by a tuple of slices."""
    if not index:
        return piece if isinstance(piece, torch.Tensor) else piece[...] if not piece.get_shape() else piece[:]
    return piece[index]


def read_ranges(piece, dim: int, ranges, per: int = 1) -> torch.Tensor | None:
    """The ranges (in values) of a piece along dim, `per` values to an element (packed words,
    groups), concatenated; None when a range does not fall on whole elements."""
    if any(start % per or stop % per for start, stop in ranges):
        return None
    parts = [read(piece, (slice(None),) * dim + (slice(start // per, stop // per),)) for start, stop in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def shape_of(piece) -> tuple[int, ...]:
    return tuple(piece.shape) if isinstance(piece, torch.Tensor) else tuple(piece.get_shape())


def gather(named_tensors: Iterable[tuple[str, torch.Tensor]], piece_of: PieceOf,
           required: Callable[[str], set[str]],
           build: Callable[[str, dict[str, torch.Tensor]], QuantWeight],
           shard_pieces: ShardPieces | None = None,
           ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Other tensors pass through; each module's pieces become one (`<module>.weight`,
    build(module, pieces)) once `required(module)` are all in. A piece that arrives after its
    module was built is one the build did not need (e.g. a trivial g_idx), and is dropped.
    With shard_pieces the pieces are lazy slices and each module is a QuantSource instead."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    built: set[str] = set()
    for name, tensor in named_tensors:
        found = piece_of(name, tensor)
        if found is None:
            yield name, tensor
            continue
        module, piece = found
        if module in built:
            continue
        parts = pending.setdefault(module, {})
        parts[piece] = tensor
        if required(module) <= parts.keys():
            del pending[module]
            built.add(module)
            yield f"{module}.weight", (build(module, parts) if shard_pieces is None
                                       else QuantSource(module, parts, build, shard_pieces))
    if pending:
        module, parts = next(iter(pending.items()))
        missing = sorted(required(module) - parts.keys())
        raise ValueError(f"quantized weight {module!r} lacks {', '.join(missing)} in the checkpoint"
                         + (f" (and {len(pending) - 1} more modules are incomplete)" if len(pending) > 1 else ""))


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words each holding 32 // bits values (value i in bits [i * bits, (i + 1) * bits))
    -> uint8 values, unpacked along `dim` (0 or 1) of a 2-D tensor."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"expected a 2-D int32 packed tensor, got {packed.dtype} {list(packed.shape)}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        values = (packed.unsqueeze(1) >> shifts.view(1, per_word, 1)) & (2 ** bits - 1)
        return values.reshape(packed.shape[0] * per_word, packed.shape[1]).to(torch.uint8)
    values = (packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)
    return values.reshape(packed.shape[0], packed.shape[1] * per_word).to(torch.uint8)


def act_order(g_idx: torch.Tensor | None, in_features: int, group_size: int, module: str
              ) -> torch.Tensor | None:
    """A g_idx (the group of each input channel) -> QuantWeight.perm, the channels sorted by
    group so each stored group is contiguous; None when it is already the identity."""
    if g_idx is None:
        return None
    g_idx = g_idx.long().flatten()
    if g_idx.numel() != in_features:
        raise ValueError(f"{module}: g_idx has {g_idx.numel()} entries for {in_features} input channels")
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(in_features) // group_size):
        raise ValueError(f"{module}: g_idx does not give every group exactly {group_size} channels")
    return None if torch.equal(perm, torch.arange(in_features)) else perm


def checked_groups(method: str, module: str, k: int, n: int, group_size: int,
                   scales_gn: torch.Tensor, zeros_gn: torch.Tensor) -> int:
    """The group size (-1 in a config: per channel) of a [n, k] weight stored input-major, once
    its per-group scales and unpacked zeros are checked to fit it."""
    group_size = k if group_size == -1 else group_size
    if k % group_size or scales_gn.shape != (k // group_size, n):
        raise ValueError(f"{module}: {method} scales {list(scales_gn.shape)} do not fit a [{n}, {k}] "
                         f"weight in groups of {group_size}")
    if zeros_gn.shape != scales_gn.shape:
        raise ValueError(f"{module}: {method} qzeros unpack to {list(zeros_gn.shape)}, scales are "
                         f"{list(scales_gn.shape)}")
    return group_size


def quant_weight(values_kn: torch.Tensor, scales_gn: torch.Tensor, zeros_gn: torch.Tensor | float,
                 bits: int, group_size: int, perm: torch.Tensor | None) -> QuantWeight:
    """Input-major unsigned values [k, n] with W = (q - zero) * scale per (group, column) ->
    a QuantWeight (its offsets -zero * scale; columns stored in perm's order)."""
    from pagedserve.kernels.quantized import pack_values
    if perm is not None:
        values_kn = values_kn[perm]
    scales = scales_gn.float().t().contiguous()
    offsets = (-(zeros_gn.float().t() if torch.is_tensor(zeros_gn) else zeros_gn) * scales).contiguous()
    return QuantWeight(bits, group_size, pack_values(values_kn.t(), bits), scales, offsets, perm)
