"""A GGUF file as a Hugging Face checkpoint: its config, its HF-named tensors (each quantized
weight one QuantWeight, converted as it is read), and its tokenizer.

    checkpoint = read_gguf("model.Q4_K_M.gguf")
    model = model_class(checkpoint.config, ...)
    model.load_weights(checkpoint.tensors())

Everything that can fail is checked when the file is opened (its sizes and offsets, every
tensor's type and name), so a bad file fails before any weight is loaded.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from pagedserve.kernels.quantized import QuantWeight
from pagedserve.replicas.parallel.sharding import Shard, read_shard
from pagedserve.replicas.quant import gguf_config
from pagedserve.replicas.quant.gguf_blocks import DENSE, QUANTIZED, SUPPORTED_TYPES
from pagedserve.replicas.quant.gguf_file import GGUFFile, type_name, type_sizes

EMBEDDING = "token_embd.weight"
ROPE_FREQS = "rope_freqs.weight"


class GGUFCheckpoint:
    """An opened GGUF file: `config` (a transformers PretrainedConfig), `tensors()`, and
    `tokenizer_dir()` (an HF tokenizer folder converted from the metadata, cached)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.names: dict[str, str] = {}  # GGUF name -> HF name, for every tensor tensors() yields
        unknown = []
        for name, info in self.file.tensors.items():
            kind = type_name(info.type_id)
            if kind not in SUPPORTED_TYPES:
                raise ValueError(f"{str(self.path)!r}: tensor {name!r} has GGUF type {kind}, which is "
                                 f"not supported: supported types are {', '.join(SUPPORTED_TYPES)}")
            if kind in QUANTIZED and len(info.dims) != 2:
                raise ValueError(f"{str(self.path)!r}: tensor {name!r} is {kind} with "
                                 f"{len(info.dims)} dimensions: only 2-D weights may be quantized")
            hf = gguf_config.hf_name(name)
            if hf is not None:
                self.names[name] = hf
            elif name != ROPE_FREQS:
                unknown.append(name)
        if unknown:
            raise ValueError(f"{str(self.path)!r}: tensors with no Hugging Face counterpart: "
                             f"{', '.join(unknown[:5])}")
        if EMBEDDING not in self.file.tensors:
            raise ValueError(f"{str(self.path)!r}: no {EMBEDDING} tensor")
        self.permuted = self.file.metadata.get("general.architecture") in gguf_config.PERMUTED_ARCHITECTURES
        embedding_rows = self.file.tensors[EMBEDDING].shape[0]
        rope_freqs = None
        if ROPE_FREQS in self.file.tensors:  # folded into the config's rope scaling
            rope_freqs = self.tensor(ROPE_FREQS).float().tolist()
        self.config = gguf_config.build_config(self.file.metadata, set(self.file.tensors),
                                               embedding_rows, str(self.path), rope_freqs)

    def tensors(self, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """(HF name, tensor or QuantWeight) for every tensor, read and converted one at a time.
        lazy: a GGUFTensor instead, which reads only a tensor-parallel rank's part."""
        for name, hf in self.names.items():
            yield hf, GGUFTensor(self, name) if lazy else self.tensor(name)

    def tensor(self, gguf_name: str, shard: Shard | None = None) -> torch.Tensor | QuantWeight:
        """One tensor, or its `shard` (replicas/parallel/sharding.py): rows are gathered from the
        memory map before they are converted; columns read the blocks that cover them (a K-quant's
        256-value super-blocks may overhang the range) and are cut exactly after conversion."""
        info = self.file.tensors[gguf_name]
        kind = type_name(info.type_id)
        raw = self.file.raw(info)
        hf = self.names.get(gguf_name)
        rows = gguf_config.unpermute_rows(hf, info.shape[0], self.config) if self.permuted and hf else None
        if shard is None or shard.zeros:
            value = _convert(kind, raw, info.shape)
            if rows is not None:
                value = value.rows(rows) if isinstance(value, QuantWeight) else value[rows].contiguous()
            return value if shard is None else read_shard(value, shard)
        if shard.dim == 0:
            wanted = torch.cat([torch.arange(start, stop) for start, stop in shard.ranges])
            part = raw[wanted if rows is None else rows[wanted]]
            return _convert(kind, part, (len(wanted), *info.shape[1:]))
        (start, stop), = shard.ranges
        block, block_bytes = type_sizes(info.type_id)
        first, last = start // block, -(-stop // block)
        part = raw[:, first * block_bytes:last * block_bytes]
        value = _convert(kind, part if rows is None else part[rows], (info.shape[0], (last - first) * block))
        return read_shard(value, Shard(1, ((start - first * block, stop - first * block),)))

    def tokenizer_dir(self, cache_dir: str | Path | None = None) -> Path:
        """A folder holding the HF tokenizer built from this file's metadata (see gguf_tokenizer)."""
        from pagedserve.replicas.quant.gguf_tokenizer import tokenizer_dir
        return tokenizer_dir(self.path, cache_dir)

    def close(self) -> None:
        self.file.close()


class GGUFTensor:
    """A tensor of an opened GGUF file, not read yet: `read_shard(shard)` converts only what a
    tensor-parallel rank holds (all of it for shard None)."""

    def __init__(self, checkpoint: GGUFCheckpoint, gguf_name: str):
        self.checkpoint, self.gguf_name = checkpoint, gguf_name
        self.quantized = type_name(checkpoint.file.tensors[gguf_name].type_id) in QUANTIZED

    def read_shard(self, shard: Shard | None) -> torch.Tensor | QuantWeight:
        return self.checkpoint.tensor(self.gguf_name, shard)


def _convert(kind: str, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | QuantWeight:
    """Raw bytes [rows, bytes per row] of a tensor (or of some of its rows or blocks) -> its value."""
    if kind in DENSE:
        return raw.contiguous().view(DENSE[kind]).reshape(shape).clone()
    return QUANTIZED[kind](raw)


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open and check a GGUF file; ValueError naming the file (and tensor) when it cannot be read."""
    return GGUFCheckpoint(path)
