"""Quantized checkpoints as they are on disk -> HF-named tensors, each quantized linear weight one
pagedserve.kernels.quantized.QuantWeight.

    method = quantization_of(model_path_or_config)   # "gguf", "gptq", "awq", "compressed-tensors", None
    checkpoint = read_gguf(path)                     # GGUF: config, tensors(), tokenizer_dir()
    weights = quantized_tensors(method, hf_config, iterate_weights(files))   # the safetensors ones

Method names are vLLM's `quantization` values. Importing this package is cheap (no torch), so
the ingress may ask which method a model uses.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from pagedserve.replicas.model_files.default_model import is_gguf

GGUF = "gguf"
SAFETENSORS_METHODS = ("gptq", "awq", "compressed-tensors")
METHODS = (GGUF, *SAFETENSORS_METHODS)


def quantization_config_of(config) -> dict | None:
    """The quantization_config of a transformers config, a config.json dict, or a checkpoint dir."""
    if isinstance(config, (str, Path)):
        path = Path(config).expanduser() / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
    found = config.get("quantization_config") if isinstance(config, dict) \
        else getattr(config, "quantization_config", None)
    if found is None or isinstance(found, dict):
        return found
    return found.to_dict()  # a transformers QuantizationConfigMixin


def quantization_of(model) -> str | None:
    """Which quantized format a model is in: a .gguf path, or a checkpoint (directory, config
    or config dict) with a quantization_config; None for a full-precision checkpoint. ValueError
    for a quantization method we cannot read."""
    if is_gguf(model):
        return GGUF
    config = quantization_config_of(model)
    if config is None:
        return None
    method = str(config.get("quant_method", "")).lower().replace("_", "-")
    if method not in SAFETENSORS_METHODS:
        raise ValueError(f"quantization method {config.get('quant_method')!r} is not supported: "
                         f"supported are {', '.join(METHODS)}")
    return method


def quantized_tensors(method: str, hf_config, named_tensors: Iterable, lazy: bool = False) -> Iterator:
    """(name, tensor) from a quantized safetensors checkpoint -> (HF name, tensor or QuantWeight):
    each quantized linear's pieces become one `<module>.weight` QuantWeight; other tensors pass
    through. The scheme is checked before the first tensor is read. lazy: the tensors are
    safetensors slices, and each module a QuantSource, which reads only a tensor-parallel rank's
    part (module_pieces.py)."""
    config = quantization_config_of(hf_config) or {}
    if method == "gptq":
        from pagedserve.replicas.quant.gptq import gptq_tensors
        return gptq_tensors(config, named_tensors, lazy)
    if method == "awq":
        from pagedserve.replicas.quant.awq import awq_tensors
        return awq_tensors(config, named_tensors, lazy)
    if method == "compressed-tensors":
        from pagedserve.replicas.quant.compressed_tensors import compressed_tensors_tensors
        return compressed_tensors_tensors(config, named_tensors, lazy)
    raise ValueError(f"quantization method {method!r} has no safetensors reader: supported are "
                     f"{', '.join(SAFETENSORS_METHODS)} (GGUF files open with read_gguf)")


def read_gguf(path):
    """See pagedserve.replicas.quant.gguf_checkpoint.read_gguf."""
    from pagedserve.replicas.quant.gguf_checkpoint import read_gguf as read
    return read(path)


__all__ = ["METHODS", "is_gguf", "quantization_config_of", "quantization_of", "quantized_tensors",
           "read_gguf"]
