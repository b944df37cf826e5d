"""A local checkpoint -> our torch model: an HF folder (config.json + safetensors, one file or
sharded, quantized or not) or a GGUF file.

Tensors stream in one at a time from each shard and are copied into the model's preallocated
parameters (casting on the way), so loading never holds a second full copy of the weights. A
quantized checkpoint (replicas/quant) streams its projections as QuantWeights, which the model
keeps quantized: it is built with those weights deferred, so their dense bytes never exist.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from pagedserve.kernels import cpu_features
from pagedserve.replicas import quant
from pagedserve.replicas.model_files.default_model import check_model_dir, is_gguf
from pagedserve.replicas.models import get_model_class
from pagedserve.replicas.models.layers import deferred_weights
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.parallel.sharding import check_tensor_parallel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_config(model_dir: str | Path):
    """The checkpoint's transformers config (a GGUF file's, from its metadata)."""
    path = check_model_dir(model_dir)
    if is_gguf(path):
        return quant.read_gguf(path).config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(path))


def tokenizer_path(model: str | Path) -> str:
    """Where AutoTokenizer finds a checkpoint's tokenizer (a GGUF file's: converted once)."""
    if not is_gguf(model):
        return str(model)
    from pagedserve.replicas.quant.gguf_tokenizer import tokenizer_dir
    return str(tokenizer_dir(model))


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" means, on a GPU, the checkpoint's own dtype (float32 when it names none or an
    unsupported one); on the CPU, the dtype that runs fastest at the CPU's level whatever the
    checkpoint is stored in, as vLLM's CPU backend does (bf16 where AVX512-BF16 computes it
    natively, else float32: kernels/cpu_features.AUTO_DTYPE, which says why), the activations of
    a weight-only quantized checkpoint included. An explicit dtype is obeyed.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}: use one of {sorted(DTYPES)}")
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: use auto or one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    # Newer transformers call it `dtype`, older ones `torch_dtype` (read directly: the new alias
    # warns).
    found = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    if isinstance(found, torch.dtype):
        found = str(found).removeprefix("torch.")
    if torch.device(device).type != "cpu":
        return DTYPES.get(found, torch.float32)
    chosen = DTYPES[cpu_features.auto_dtype()]
    if found in DTYPES and DTYPES[found] != chosen:
        logger.info("checkpoint dtype is %s; running %s, the faster on this CPU (dtype=%s forces "
                    "the checkpoint's)", found, str(chosen).removeprefix("torch."), found)
    return chosen


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, or the single file."""
    path = Path(model_dir)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SAFETENSORS_FILE).is_file():
        return [path / SAFETENSORS_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(path)!r} "
                         f"(expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX})")
    return files


def iterate_weights(files: list[Path], progress: bool | None = None, lazy: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read one at a time. lazy: a safetensors
    slice instead, read when indexed (a tensor-parallel rank reads only its part)."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    total = 0
    for file in files:  # reads headers only
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    if progress is None:
        progress = sys.stderr.isatty()
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for file in files:
            bar.set_postfix_str(file.name)
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_slice(name) if lazy else f.get_tensor(name)
                    bar.update()


def _with_progress(tensors: Iterable, total: int, progress: bool | None = None) -> Iterator:
    from tqdm.auto import tqdm
    disable = not (sys.stderr.isatty() if progress is None else progress)
    yield from tqdm(tensors, total=total, desc="Loading weights", unit="tensor", disable=disable)


def checkpoint_tensors(path: Path, quantization: str | None = None, lazy: bool = False):
    """(hf_config, the quantization method or None, the (name, tensor | QuantWeight) stream,
    a description for the log) of a checkpoint, checking `quantization` against what it holds."""
    method = quant.quantization_of(path)
    if quantization is not None and quantization != method:
        raise ValueError(f"quantization={quantization!r}, but {path.name!r} is "
                         + (f"quantized with {method!r}" if method else "not quantized"))
    if method == "gguf":
        checkpoint = quant.read_gguf(path)
        return (checkpoint.config, method,
                _with_progress(checkpoint.tensors(lazy), len(checkpoint.names)), "GGUF")
    hf_config = load_config(path)
    files = weight_files(path)
    tensors = iterate_weights(files, lazy=lazy)
    if method is not None:
        tensors = quant.quantized_tensors(method, hf_config, tensors, lazy)
    return hf_config, method, tensors, f"{len(files)} file(s)"


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               attention_backend: str = "auto", tp: parallel_state.TensorParallel = parallel_state.SINGLE,
               quantization: str | None = None):
    """Build the model for a checkpoint (folder or GGUF file) and load its weights (`tp`: this
    rank's shard).

    Returns (model, hf_config, torch_dtype); the model is in eval mode on `device`.
    """
    path = check_model_dir(model_dir)
    start = time.perf_counter()
    hf_config, method, tensors, source = checkpoint_tensors(path, quantization, lazy=tp.world_size > 1)
    model_class = get_model_class(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config, resolve_device(device))
    check_tensor_parallel(hf_config, tp.world_size, model_class, quantized=method is not None)
    with parallel_state.building(tp), deferred_weights() if method else contextlib.nullcontext():
        model = model_class(hf_config, torch_dtype, attention_backend, device=resolve_device(device))
    model.load_weights(tensors)
    model.eval()
    model.pack_weights()
    logger.info("loaded %s (%s, %s%s, %s) in %.1f s", path.name, model_class.__name__,
                str(torch_dtype).removeprefix("torch."), f", {method}" if method else "", source,
                time.perf_counter() - start)
    return model, hf_config, torch_dtype
