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

from kernels.quantized import QuantWeight
from replicas.quant import gguf_config
from replicas.quant.gguf_blocks import DENSE, QUANTIZED, SUPPORTED_TYPES
from replicas.quant.gguf_file import GGUFFile, type_name

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

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """(HF name, tensor or QuantWeight) for every tensor, read and converted one at a time."""
        for name, hf in self.names.items():
            yield hf, self.tensor(name)

    def tensor(self, gguf_name: str) -> torch.Tensor | QuantWeight:
        info = self.file.tensors[gguf_name]
        kind = type_name(info.type_id)
        raw = self.file.raw(info)
        if kind in DENSE:
            value = raw.contiguous().view(DENSE[kind]).reshape(info.shape).clone()
        else:
            value = QUANTIZED[kind](raw)
        hf = self.names.get(gguf_name)
        rows = gguf_config.unpermute_rows(hf, info.shape[0], self.config) if self.permuted and hf else None
        if rows is not None:
            value = value.rows(rows) if isinstance(value, QuantWeight) else value[rows].contiguous()
        return value

    def tokenizer_dir(self, cache_dir: str | Path | None = None) -> Path:
        """A folder holding the HF tokenizer built from this file's metadata (see gguf_tokenizer)."""
        from replicas.quant.gguf_tokenizer import tokenizer_dir
        return tokenizer_dir(self.path, cache_dir)

    def close(self) -> None:
        self.file.close()


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open and check a GGUF file; ValueError naming the file (and tensor) when it cannot be read."""
    return GGUFCheckpoint(path)
