"""The data plane of one step: SchedulerOutput -> tensors -> model -> logits -> sampled tokens.

The runner owns the model, the paged KV cache tensors, the persistent input batch and the sampler.
It reads the scheduler's sequences but never mutates them. Under tensor parallelism it is rank 0:
it holds its own shard and sends each step's input to the other ranks (replicas/parallel).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.kernels import cpu_linear
from pagedserve.kernels.metadata import kv_cache_bytes_per_block, kv_cache_shape
from pagedserve.replicas.core.block_manager import kv_window_of
from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.execution.input_batch import InputBatch
from pagedserve.replicas.models.loader import DTYPES, load_model, resolve_device
from pagedserve.replicas.core.outputs import PositionLogprobs
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.execution.pooler import PromptPooler
from pagedserve.replicas.execution.sampler import Sampler, compute_prompt_logprobs
from pagedserve.replicas.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    # Per scheduled sequence that samples, in schedule order: its new token, or under
    # speculative decoding its accepted drafts and the token after them.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[PositionLogprobs] | None]  # aligned with sampled_token_ids, where asked
    # seq_id -> (first prompt position p, logprobs of prompt tokens p+1, p+2, ...)
    prompt_logprobs: dict[int, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)
    pooled: dict[int, list[float]] = field(default_factory=dict)  # seq_id -> pooling embedding


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str):
        self.config = config
        self.device = resolve_device(config.device)
        self.workers = None  # ranks 1.. under tensor parallelism
        tp = parallel_state.SINGLE
        num_threads = config.num_threads
        if config.tensor_parallel_size > 1:
            from pagedserve.replicas.parallel.executor import Workers, threads_per_rank
            self.workers = Workers(config, model_dir, self.device)
            tp, num_threads = self.workers.tp, threads_per_rank(config)
        if self.device.type == "cpu" and num_threads:
            torch.set_num_threads(num_threads)
        self.model, self.hf_config, self.dtype = load_model(
            model_dir, dtype=config.dtype, device=str(self.device),
            attention_backend=config.attention_backend, tp=tp,
            quantization=config.quantization)
        # The adapters' slot pool before the KV cache, which takes the device memory left.
        self.lora = None  # the LoRAManager, under enable_lora
        if config.enable_lora:
            from pagedserve.replicas.lora.manager import LoRAManager
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras, self.dtype, self.device)
        self.kv_cache_dtype = self.dtype if config.kv_cache_dtype == "auto" else DTYPES[config.kv_cache_dtype]
        if self.kv_cache_dtype != self.dtype and self.device.type != "cpu":
            raise ValueError("kv_cache_dtype other than the model dtype is supported on CPU only")
        # What runs here, for stats(): the dtypes and, on CPU, the CPU level and GEMM kernels.
        self.platform = {"dtype": str(self.dtype).removeprefix("torch."),
                         "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
                         "cpu": cpu_linear.describe(self.dtype) if self.device.type == "cpu" else None}
        cfg = self.hf_config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = self.model.num_local_kv_heads  # this rank's, in its cache
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        if self.workers is not None:  # every rank's cache has the same blocks (of its heads)
            self.workers.start(self.num_blocks)
        shape = kv_cache_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                          for _ in range(self.num_layers)]
        self.sampler = Sampler(self.vocab_size, self.device, config.max_num_seqs)
        # A sequence's table never has more entries than the model's context needs, nor than the
        # cache has blocks unless a sliding window drops them (their entries stay, as NULL_BLOCK).
        max_blocks_per_seq = -(-self.model.max_context_len // self.block_size)
        if kv_window_of(getattr(self.model, "sliding_windows", None)) is None:
            max_blocks_per_seq = min(max_blocks_per_seq, self.num_blocks)
        self.pooler = PromptPooler()
        self.input_batch = InputBatch(config.max_num_seqs, config.max_num_batched_tokens,
                                      max_blocks_per_seq, self.block_size, self.device)
        logger.info("kv cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                    self.num_blocks * self.bytes_per_block / 2**30)

    @property
    def bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.block_size, self.num_kv_heads, self.head_dim,
                                        self.num_layers, self.kv_cache_dtype)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total
        else:
            budget = self.config.kv_cache_memory_gb * 2**30
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: raise kv_cache_memory_gb / "
                             "gpu_memory_utilization or set num_kv_blocks")
        return num_blocks

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for seq in out.preempted:  # its blocks are gone; it rejoins with a new table
            self.input_batch.release(seq.seq_id)
        step = self.input_batch.prepare(out.scheduled)
        if self.lora is not None:
            self.lora.prepare([s.seq.lora_id for s in out.scheduled],
                              [s.num_new_tokens for s in out.scheduled])
        spans = self._prompt_logprob_spans(out, step.query_start_loc)
        if self.workers is not None:
            self._send_step(step, spans)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata)
        prompt_logprobs = self._prompt_logprobs(spans, hidden)
        pooled = self.pooler.update(out.scheduled, hidden, step.query_start_loc)
        if not step.sampling_seqs:
            return RunnerOutput([], [], prompt_logprobs, pooled)
        logits = self.model.compute_logits(hidden[step.logits_indices])
        if step.spec_token_ids is not None:
            tokens, logprobs = self.sampler.verify(logits, step.sampling_seqs, step.spec_token_ids)
            return RunnerOutput(tokens, logprobs, prompt_logprobs, pooled)
        sampled = self.sampler(logits, step.sampling_seqs)
        return RunnerOutput([[t] for t in sampled.sampled_token_ids],
                            [None if p is None else [p] for p in sampled.logprobs],
                            prompt_logprobs, pooled)

    def check_health(self) -> None:
        """RuntimeError when a tensor-parallel rank has died (the replica must be replaced)."""
        if self.workers is not None:
            self.workers.check_alive()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any, and the adapter loader."""
        if self.lora is not None:
            self.lora.shutdown()
        if self.workers is not None:
            self.workers.shutdown()

    def _send_step(self, step, spans) -> None:
        from pagedserve.replicas.parallel.worker import StepInput
        rows = [(first, last - start) for _, start, last, first in spans]
        self.workers.send(StepInput.of(step.input_ids, step.positions, step.metadata, rows,
                                       step.logits_indices if step.sampling_seqs else None))

    def release(self, seq_id: int) -> None:
        """A finished or aborted sequence: free its input-batch row and its sampler state."""
        self.input_batch.release(seq_id)
        self.sampler.release(seq_id)
        self.pooler.release(seq_id)

    def _prompt_logprob_spans(self, out: SchedulerOutput, query_start_loc: np.ndarray) -> list:
        """(seq, first prompt position, last, first hidden row) of each sequence whose prompt
        logprobs this step computes, in order (every tensor-parallel rank makes these calls)."""
        spans = []
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            num_logprobs = seq.sampling_params.prompt_logprobs
            if num_logprobs is None or seq.index != 0:
                continue
            start = item.start
            last = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)  # next token is a prompt token
            if start >= last:
                continue
            spans.append((seq, start, last, int(query_start_loc[i])))
        return spans

    def _prompt_logprobs(self, spans: list, hidden: torch.Tensor
                         ) -> dict[int, tuple[int, list[PositionLogprobs]]]:
        result = {}
        for seq, start, last, first in spans:
            logits = self.model.compute_logits(hidden[first:first + last - start])
            result[seq.seq_id] = (start, compute_prompt_logprobs(
                logits, seq.token_ids[start + 1:last + 1], seq.sampling_params.prompt_logprobs))
        return result
