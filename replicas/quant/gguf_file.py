"""The GGUF container (llama.cpp's file format): metadata key/values, tensor infos, tensor bytes.

The header is parsed here rather than by gguf.GGUFReader because every size and offset must be
checked against the file before any tensor byte is touched (a truncated or corrupt file is a
ValueError naming it, never a crash), and because the reader's per-element parsing of the
tokenizer arrays costs seconds on every load. Tensor data stays in a copy-on-write memory map:
`raw` returns one tensor's bytes without reading the rest of the file.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> struct format (8: string, 9: array are handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (contiguous) axis
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch order (outermost first): a weight [n, k] has dims (k, n)."""
        return tuple(reversed(self.dims))


def type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown type {type_id}"


def type_sizes(type_id: int) -> tuple[int, int] | None:
    """(values per block, bytes per block) of a GGML type, None if the gguf package lacks it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> value; arrays as lists), `tensors` (name -> info)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
            raise ValueError(f"cannot read GGUF file {str(self.path)!r}: {error}") from None
        self.size = len(self._map)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as error:
            raise self.error(f"corrupt header ({type(error).__name__}: {error})") from None

    def error(self, what: str) -> ValueError:
        return ValueError(f"{str(self.path)!r} is not a valid GGUF file: {what}")

    # -- header ------------------------------------------------------------------------------

    def _take(self, count: int) -> bytes:
        if count < 0 or self._pos + count > self.size:
            raise self.error(f"truncated: needs {count} bytes at offset {self._pos}, the file "
                             f"has {self.size}")
        data = self._map[self._pos:self._pos + count]
        self._pos += count
        return data

    def _unpack(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._unpack("<Q")).decode("utf-8")

    def _value(self, type_id: int):
        if type_id in _SCALARS:
            return self._unpack(_SCALARS[type_id])
        if type_id == _STRING:
            return self._string()
        if type_id == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALARS and item_type != 7:  # numbers in one read
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self._take(count * size)))
            if count > self.size:
                raise self.error(f"an array claims {count} items")
            return [self._value(item_type) for _ in range(count)]
        raise self.error(f"unknown metadata value type {type_id} at offset {self._pos}")

    def _parse(self) -> None:
        if self._take(4) != MAGIC:
            raise self.error("no GGUF magic number at the start")
        version = self._unpack("<I")
        if version not in VERSIONS:
            raise self.error(f"GGUF version {version} (supported: {', '.join(map(str, VERSIONS))}; "
                             "a big-endian file reads as a huge version)")
        num_tensors, num_kv = self._unpack("<Q"), self._unpack("<Q")
        if num_tensors > self.size or num_kv > self.size:
            raise self.error(f"header claims {num_tensors} tensors and {num_kv} metadata keys")
        self.metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._unpack("<I")
            if not 1 <= num_dims <= MAX_DIMS:
                raise self.error(f"tensor {name!r} has {num_dims} dimensions")
            dims = tuple(self._unpack("<Q") for _ in range(num_dims))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self.error(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            if name in self.tensors:
                raise self.error(f"tensor {name!r} appears twice")
            self.tensors[name] = self._tensor_info(name, dims, type_id, data_start + offset)

    def _tensor_info(self, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
        sizes = type_sizes(type_id)
        if sizes is None:  # its size is unknown, so nothing about it can be checked
            return TensorInfo(name, type_id, dims, offset, 0)
        block, block_bytes = sizes
        if dims[0] % block:
            raise self.error(f"tensor {name!r} ({type_name(type_id)}) has rows of {dims[0]} values, "
                             f"not a multiple of its block of {block}")
        count = 1
        for dim in dims:
            count *= dim
        nbytes = count // block * block_bytes
        if offset + nbytes > self.size:
            raise self.error(f"truncated: tensor {name!r} needs bytes {offset}..{offset + nbytes}, "
                             f"the file has {self.size}")
        return TensorInfo(name, type_id, dims, offset, nbytes)

    # -- data --------------------------------------------------------------------------------

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes, uint8 [rows, bytes per row] (rows: every axis but the innermost),
        viewing the memory map: nothing is copied until it is written."""
        rows = 1
        for dim in info.dims[1:]:
            rows *= dim
        data = torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return data.view(rows, info.nbytes // rows)

    def close(self) -> None:
        self._map.close()

