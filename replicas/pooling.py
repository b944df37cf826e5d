"""Sentence embeddings from hidden states: the pooling a checkpoint asks for, then normalization.

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


def pool(hidden, seq_starts: list[int], config: PoolingConfig):
    """hidden [T, H] of packed sequences (sequence i: rows seq_starts[i]:seq_starts[i+1]) ->
    [num_seqs, H] float32 embeddings."""
    import torch
    import torch.nn.functional as F

    hidden = hidden.float()
    starts = torch.tensor(seq_starts, dtype=torch.int64, device=hidden.device)
    lengths = starts[1:] - starts[:-1]
    mode = config.mode
    if mode == "cls":
        pooled = hidden[starts[:-1]]
    elif mode == "last":
        pooled = hidden[starts[1:] - 1]
    elif mode == "max":
        pooled = torch.stack([hidden[s:e].amax(0) for s, e in zip(seq_starts[:-1], seq_starts[1:])])
    else:  # a segment sum over the packed rows: one index_add, no padding
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device),
                                               lengths)
        sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, seq_of_token, hidden)
        divisor = lengths if mode == "mean" else lengths.float().sqrt()
        pooled = sums / divisor.unsqueeze(1).to(sums.dtype)
    return F.normalize(pooled, p=2, dim=1) if config.normalize else pooled


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


class PromptPooler:
    """A decoder's pooling requests, in the model runner: their prompts' final hidden states are
    pooled as the chunks of the prompt run (chunked prefill spreads one prompt over several
    steps), and each is done in the step that reaches the prompt's end."""

    def __init__(self):
        self._sums: dict[int, object] = {}  # seq_id -> float32 sum of its rows so far ("mean")

    def update(self, scheduled, hidden, query_start_loc) -> dict[int, list[float]]:
        """scheduled: the step's ScheduledSeqs; hidden [T, H] their packed rows -> the embeddings
        (normalized) of the pooling sequences whose prompt ended this step, by seq_id."""
        import torch.nn.functional as F

        done = {}
        for i, item in enumerate(scheduled):
            seq = item.seq
            mode = seq.sampling_params.pooling
            if mode is None:
                continue
            if item.start == 0:  # first chunk, or a preempted sequence recomputing from 0
                self._sums.pop(seq.seq_id, None)
            first = int(query_start_loc[i])
            rows = hidden[first:first + item.num_new_tokens].float()
            if mode == "mean":
                total = rows.sum(0)
                previous = self._sums.get(seq.seq_id)
                self._sums[seq.seq_id] = total if previous is None else previous + total
            if not item.samples:
                continue
            if mode == "last":
                pooled = rows[-1]
            else:
                pooled = self._sums.pop(seq.seq_id) / seq.num_prompt_tokens
            done[seq.seq_id] = F.normalize(pooled, dim=0).tolist()
        return done

    def release(self, seq_id: int) -> None:
        self._sums.pop(seq_id, None)


def pooling_params(mode: str):
    """The SamplingParams of a decoder's pooling request: prefill only (its one sampled token is
    never read), the output when it finishes."""
    from replicas.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, pooling=mode,
                          output_kind=RequestOutputKind.FINAL_ONLY)
