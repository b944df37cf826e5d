"""A tensor-parallel rank other than the driver's: its model shard, the KV cache of its heads,
and a loop that runs each step the driver broadcasts.

Why rank 0 is the driver itself, not one more worker: the driver must hold the scheduler, the
block manager and the sampler anyway, and its rank's forward is on the step's critical path; run
in the driver's process it costs no extra hop for its inputs or for the sampled tokens (the
logits are gathered to it by the lm_head's collective), and tensor_parallel_size 1 stays exactly
the plain runner. Ranks 1..N-1 are this class, in local processes (the offline LLM) or Ray
actors (a Serve replica), the same code either way.

Each step the driver broadcasts one `StepInput` (the prepared input tensors and the rows it will
compute logits for, in the order it will), so every rank runs the same collectives in the same
order; the workers keep no per-sequence state and return nothing. The same block tables serve
every rank: a rank's cache holds its own KV heads of each block.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from pagedserve.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInput:
    """What a worker needs for one step: compact CPU copies, whatever device the driver uses."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # The driver's compute_logits calls, in order: (first row, number of rows) of the step's
    # hidden states (prompt logprobs), then the sampled rows' indices (or None: no sampling).
    prompt_logit_rows: list[tuple[int, int]]
    logits_indices: torch.Tensor | None

    @classmethod
    def of(cls, input_ids, positions, metadata: AttentionMetadata, prompt_logit_rows,
           logits_indices) -> "StepInput":
        # Copies: the driver's tensors are views of its persistent buffers (pickling a view
        # would send the whole buffer) and may live on a device.
        step = cls(input_ids, positions, metadata, prompt_logit_rows, logits_indices)
        return step._map(lambda t: t.to("cpu", copy=True))

    def to(self, device: torch.device) -> "StepInput":
        return self if device.type == "cpu" else self._map(lambda t: t.to(device))

    def _map(self, move) -> "StepInput":
        """The same step with every tensor passed through move (the host lists stay)."""
        m = self.metadata
        meta = dataclasses.replace(m, slot_mapping=move(m.slot_mapping),
                                   query_start_loc=move(m.query_start_loc),
                                   seq_lens=move(m.seq_lens), block_tables=move(m.block_tables))
        indices = None if self.logits_indices is None else move(self.logits_indices)
        return StepInput(move(self.input_ids), move(self.positions), meta, self.prompt_logit_rows,
                         indices)


def run_step(model, kv_caches: list[torch.Tensor], step: StepInput) -> None:
    """A worker's share of one step: the forward and the lm_head's gathers, outputs dropped."""
    hidden = model(step.input_ids, step.positions, kv_caches, step.metadata)
    for first, num_rows in step.prompt_logit_rows:
        model.compute_logits(hidden[first:first + num_rows])
    if step.logits_indices is not None:
        model.compute_logits(hidden[step.logits_indices])


class TensorParallelWorker:
    """Rank `rank` of `world_size`; `run()` is its whole life (a process target, or one long
    Ray actor call whose end, normal or not, is how the driver sees the rank go)."""

    def __init__(self, config: dict, model_dir: str, rank: int, world_size: int, address: str,
                 num_threads: int):
        self.config, self.model_dir = config, model_dir
        self.rank, self.world_size, self.address = rank, world_size, address
        self.num_threads = num_threads

    def run(self) -> None:
        import torch.distributed as dist

        from pagedserve.kernels.metadata import kv_cache_shape
        from pagedserve.replicas.config import EngineConfig
        from pagedserve.replicas.models.loader import DTYPES, load_model
        from pagedserve.replicas.parallel import state as parallel_state

        config = EngineConfig.model_validate(self.config)
        device = self._device(config)
        if device.type == "cpu":
            torch.set_num_threads(self.num_threads)
        tp = parallel_state.init(self.rank, self.world_size, self.address, device)
        try:
            model, _, dtype = load_model(self.model_dir, dtype=config.dtype, device=str(device),
                                         attention_backend=config.attention_backend, tp=tp,
                                         quantization=config.quantization)
            kv_dtype = dtype if config.kv_cache_dtype == "auto" else DTYPES[config.kv_cache_dtype]
            model.set_max_model_len(config.max_model_len)  # as the driver's LLMEngine does
            num_blocks = self._receive(tp)
            if num_blocks is None:  # the driver failed to start
                return
            shape = kv_cache_shape(num_blocks, config.block_size, model.num_local_kv_heads,
                                   model.head_dim)
            kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=device)
                         for _ in range(model.num_layers)]
            with torch.inference_mode():
                while (step := self._receive(tp)) is not None:
                    run_step(model, kv_caches, step.to(device))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def _device(self, config) -> torch.device:
        from pagedserve.replicas.models.loader import resolve_device
        device = resolve_device(config.device)
        if device.type == "cuda":  # a Ray actor sees its own GPU as 0; a local process its rank's
            index = 0 if torch.cuda.device_count() == 1 else self.rank
            device = torch.device("cuda", index)
            torch.cuda.set_device(device)
        return device

    @staticmethod
    def _receive(tp):
        import torch.distributed as dist
        box = [None]
        dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
        return box[0]


if __name__ == "__main__":  # a local rank: its arguments arrive pickled on stdin
    import pickle
    import sys

    logging.basicConfig(level=logging.WARNING)
    TensorParallelWorker(*pickle.load(sys.stdin.buffer)).run()
