"""Where a PEFT adapter's modules land in our model.

An adapter names the Hugging Face modules it changes (`model.layers.0.self_attn.q_proj`); our
model fuses some of them (q|k|v into qkv_proj, gate|up into gate_up_proj) and reorders rows on
loading for some families. The model already says, per parameter, which checkpoint tensors fill
which of its rows (`checkpoint_sources`) and how a tensor's rows move (`convert`): the same two
facts place an adapter's B rows, so every family that loads a checkpoint takes its adapters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.replicas.models.layers import Linear


@dataclass(frozen=True)
class Target:
    """One checkpoint module an adapter may change: part `part` of our projection `linear`."""
    linear: str
    part: int
    in_features: int
    out_features: int  # rows of this part
    row_order: torch.Tensor | None  # the model's reordering of this part's rows, if any


class LoRATargets:
    """The model's projections an adapter can change, by checkpoint module name."""

    def __init__(self, model: torch.nn.Module):
        self.by_module: dict[str, Target] = {}
        self.parts: dict[str, list[tuple[int, int]]] = {}  # our projection -> its parts' rows
        self.checkpoint_prefix = getattr(model, "checkpoint_prefix", "")
        lm_head = getattr(model, "lm_head", None)
        # A module whose projections see the step's rows regrouped (a mixture of experts' experts)
        # says so with `takes_lora = False`: the slot of a row could not follow it there.
        closed = tuple(f"{name}." for name, module in model.named_modules()
                       if getattr(module, "takes_lora", True) is False)
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or module is lm_head or name.startswith(closed):
                continue
            out_features, in_features = module.out_features, module.in_features
            sources = model.checkpoint_sources(f"{name}.weight")
            parts = []
            for index, (hf_name, rows) in enumerate(sources):
                start, stop = (0, out_features) if rows is None else (rows.start, rows.stop)
                parts.append((start, stop))
                self.by_module[hf_name.removesuffix(".weight")] = Target(
                    name, index, in_features, stop - start, _row_order(model, hf_name, stop - start))
            self.parts[name] = parts

    def find(self, module_name: str) -> Target | None:
        """The target of an adapter's module name (PEFT's `base_model.model.` prefix removed)."""
        return self.by_module.get(module_name) or self.by_module.get(self.checkpoint_prefix + module_name)

    def names(self) -> list[str]:
        """The short names an adapter may target (q_proj, ...), for error messages."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.by_module})


def _row_order(model, hf_name: str, num_rows: int) -> torch.Tensor | None:
    """How the model's convert() moves this tensor's rows: None if it leaves them (or transposes
    the tensor, as GPT-2's Conv1D layout does: a LoRA B is [out, r] there already)."""
    probe = torch.arange(num_rows, dtype=torch.float64).unsqueeze(1)
    moved = model.convert(hf_name, probe)
    if moved.shape != probe.shape:
        return None
    order = moved[:, 0].long()
    return None if torch.equal(order, torch.arange(num_rows)) else order
