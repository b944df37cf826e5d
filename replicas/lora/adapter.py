"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) and checking it
against the model before it can serve: every error names what is wrong, and nothing half-read
ever reaches a slot."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.replicas.core.lora_request import LoRARequest
from pagedserve.replicas.lora.targets import LoRATargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_ALPHA = 8  # PEFT's LoraConfig default, for a config that leaves lora_alpha out
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served, and why."""


@dataclass
class LoRAAdapter:
    """An adapter in memory, ready for a slot: per projection, per part, (A [r, in], B^T scaled
    [r, rows]) in the model's dtype."""
    lora: LoRARequest
    rank: int
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterError(f"adapter directory {str(path)!r} does not exist")
    if not file.is_file():
        raise AdapterError(f"adapter directory {str(path)!r} has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported: only LORA adapters are")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full copies of "
                     "modules)"), ("layer_replication", "layer_replication")):
        if config.get(key):
            raise AdapterError(f"{why} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']!r} is not supported: only bias='none' adapters are")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(f"{CONFIG_FILE}: r must be a positive integer")
    return config


def read_adapter(lora: LoRARequest, targets: LoRATargets, max_rank: int, dtype: torch.dtype
                 ) -> LoRAAdapter:
    """The adapter at lora.lora_path, checked against the model's targets and max_rank. Any
    failure is an AdapterError: the files are the user's, and no content of theirs may take
    the engine down."""
    try:
        return _read(lora, targets, max_rank, dtype)
    except AdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - a value of a type or shape nothing above checked
        raise AdapterError(f"the adapter cannot be read: {type(exc).__name__}: {exc}") from None


def _read(lora: LoRARequest, targets: LoRATargets, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(lora.lora_path)
    config = read_config(path)
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"adapter directory {str(path)!r} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key.removeprefix(_PREFIX))
        if match is None:
            raise AdapterError(f"{WEIGHTS_FILE}: unexpected tensor {key!r} (only lora_A / lora_B "
                               "weights of linear projections are supported)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoRAAdapter(lora, 0)
    for module, pair in sorted(pairs.items()):
        target = targets.find(module)
        if target is None:
            raise AdapterError(f"target module {module!r}: the model has no such projection "
                               f"(adapters may change {', '.join(targets.names())})")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{module}: lora_A and lora_B must both be present")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterError(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are "
                               "not [r, in] and [out, r]")
        rank = a.shape[0]
        if (a.shape[1], b.shape[0]) != (target.in_features, target.out_features):
            raise AdapterError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not "
                               f"fit the model's [{target.out_features}, {target.in_features}] "
                               "projection (an adapter of another base model?)")
        if rank > max_rank:
            raise AdapterError(f"{module}: rank {rank} is above max_lora_rank={max_rank}")
        b = b.float() * _scaling(config, module, rank)
        if target.row_order is not None:
            b = b[target.row_order]
        adapter.weights.setdefault(target.linear, {})[target.part] = (
            a.to(dtype).contiguous(), b.t().to(dtype).contiguous())
        adapter.rank = max(adapter.rank, rank)
    return adapter


def _scaling(config: dict, module: str, rank: int) -> float:
    """lora_alpha / r, or / sqrt(r) under rsLoRA; alpha_pattern overrides alpha per module, as
    PEFT matches it (the pattern against the module name's end)."""
    alpha = config.get("lora_alpha", DEFAULT_ALPHA)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
