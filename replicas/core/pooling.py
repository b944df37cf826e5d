"""Pooling requests: the pooling a checkpoint asks for and the records an embedding leaves in
(the tensor work is `execution/pooler.py`).

A sentence-transformers directory says how it pools in `modules.json` (a Pooling module's folder,
usually `1_Pooling/config.json`, and whether a Normalize module follows). A decoder checkpoint in
pooling mode uses `last` (the final token's state: what a causal model has seen the whole text
at) or `mean`, from the engine's `pooling` setting, normalized.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PoolingMode = Literal["cls", "mean", "max", "mean_sqrt_len", "last"]

# sentence-transformers' Pooling config keys -> our mode (the first one set wins).
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
             "pooling_mode_lasttoken": "last"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# Used when a directory has no sentence-transformers modules (a plain HF BERT checkpoint).
DEFAULT_ENCODER_POOLING = "mean"


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    mode: PoolingMode = DEFAULT_ENCODER_POOLING
    normalize: bool = True

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "PoolingConfig":
        """The pooling a sentence-transformers directory declares; mean + normalize otherwise."""
        path = Path(model_dir)
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return cls()
        modules = json.loads(modules_file.read_text())
        types = [m.get("type", "") for m in modules]
        mode = DEFAULT_ENCODER_POOLING
        for module in modules:
            if module.get("type") == _ST_POOLING:
                config = json.loads((path / module.get("path", "") / "config.json").read_text())
                enabled = [ours for key, ours in _ST_MODES.items() if config.get(key)]
                if len(enabled) > 1:
                    raise ValueError(f"{path}: pooling modes {enabled} combined are not supported")
                mode = enabled[0] if enabled else mode
        return cls(mode=mode, normalize=_ST_NORMALIZE in types)


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's shape: `output.outputs.embedding` is the list of floats."""

    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def pooling_params(mode: str):
    """The SamplingParams of a decoder's pooling request: prefill only (its one sampled token is
    never read), the output when it finishes."""
    from pagedserve.replicas.core.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, pooling=mode,
                          output_kind=RequestOutputKind.FINAL_ONLY)
