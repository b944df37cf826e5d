"""A local HF checkpoint (config.json + safetensors, one file or sharded) -> our torch model.

Tensors stream in one at a time from each shard and are copied into the model's preallocated
parameters (casting on the way), so loading never holds a second full copy of the weights.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from kernels import cpu_features
from replicas.default_model import check_model_dir
from replicas.models import get_model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_config(model_dir: str | Path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(check_model_dir(model_dir)))


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" means the checkpoint's own dtype (float32 when it names none or an unsupported one),
    as in vLLM, with the CPU's exceptions: half-precision checkpoints (fp16 too, as vLLM's CPU
    backend casts it, torch's CPU fp16 kernels being slow) run in the dtype measured fastest at the
    CPU level, kernels/cpu_features.AUTO_DTYPE (which says why). An explicit dtype is obeyed.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}: use one of {sorted(DTYPES)}")
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: use auto or one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    # transformers 5 calls it `dtype`; 4.x `torch_dtype` (read directly: the 5.x alias warns).
    found = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    if isinstance(found, torch.dtype):
        found = str(found).removeprefix("torch.")
    resolved = DTYPES.get(found, torch.float32)
    if torch.device(device).type != "cpu" or resolved == torch.float32:
        return resolved
    chosen = DTYPES[cpu_features.auto_dtype()]
    if chosen != resolved:
        logger.info("checkpoint dtype is %s, which this CPU has no fast kernels for: running %s "
                    "(dtype=%s forces it)", found, str(chosen).removeprefix("torch."), found)
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


def iterate_weights(files: list[Path], progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read one at a time."""
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
                    yield name, f.get_tensor(name)
                    bar.update()


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               attention_backend: str = "auto"):
    """Build the model for a checkpoint directory and load its weights.

    Returns (model, hf_config, torch_dtype); the model is in eval mode on `device`.
    """
    path = check_model_dir(model_dir)
    start = time.perf_counter()
    hf_config = load_config(path)
    model_class = get_model_class(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config, resolve_device(device))
    files = weight_files(path)
    model = model_class(hf_config, torch_dtype, attention_backend, device=resolve_device(device))
    model.load_weights(iterate_weights(files))
    model.eval()
    model.pack_weights()
    logger.info("loaded %s (%s, %s, %d file(s)) in %.1f s", path.name, model_class.__name__,
                str(torch_dtype).removeprefix("torch."), len(files), time.perf_counter() - start)
    return model, hf_config, torch_dtype
