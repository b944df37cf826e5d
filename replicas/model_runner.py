"""The data plane of one step: SchedulerOutput -> tensors -> model -> logits -> sampled tokens.

The runner owns the model, the paged KV cache tensors and the sampler. It reads the scheduler's
sequences but never mutates them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kernels import AttentionMetadata
from replicas.config import EngineConfig
from replicas.model_loader import load_model
from replicas.outputs import PositionLogprobs
from replicas.sampler import Sampler, compute_prompt_logprobs
from replicas.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    sampled_token_ids: list[int]  # one per scheduled sequence that samples, in schedule order
    logprobs: list[PositionLogprobs | None]  # aligned with sampled_token_ids
    # seq_id -> (first prompt position p, logprobs of prompt tokens p+1, p+2, ...)
    prompt_logprobs: dict[int, tuple[int, list[PositionLogprobs]]] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str):
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model, self.hf_config, self.dtype = load_model(
            model_dir, dtype=config.dtype, device=str(self.device),
            attention_backend=config.attention_backend)
        cfg = self.hf_config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.num_layers)]
        self.sampler = Sampler(self.vocab_size, self.device)
        logger.info("kv cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                    self.num_blocks * self.bytes_per_block / 2**30)

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

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
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, block_tables = [], [], []
        logits_rows, sampling_seqs = [], []
        prompt_rows = []  # (seq, start position, first row, row count, next token ids)
        bs = self.block_size
        row = 0
        for item in out.scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            block_tables.append(table)
            if (seq.sampling_params.prompt_logprobs is not None and seq.index == 0
                    and start < seq.num_prompt_tokens - 1):
                last = min(end, seq.num_prompt_tokens - 1)  # positions whose next token is a prompt token
                prompt_rows.append((seq, start, row, last - start, seq.token_ids[start + 1:last + 1]))
            row += n
            if item.samples:
                logits_rows.append(row - 1)
                sampling_seqs.append(seq)

        dev = self.device
        width = max(len(t) for t in block_tables)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0] + _cumsum(query_lens), dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                      dtype=torch.int32, device=dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev),
                            self.kv_caches, metadata)

        prompt_logprobs = {}
        for seq, start, first, count, next_ids in prompt_rows:
            logits = self.model.compute_logits(hidden[first:first + count])
            prompt_logprobs[seq.seq_id] = (start, compute_prompt_logprobs(
                logits, next_ids, seq.sampling_params.prompt_logprobs))

        if not sampling_seqs:
            return RunnerOutput([], [], prompt_logprobs)
        logits = self.model.compute_logits(hidden[torch.tensor(logits_rows, device=dev)])
        sampled = self.sampler(logits, sampling_seqs)
        return RunnerOutput(sampled.sampled_token_ids, sampled.logprobs, prompt_logprobs)

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out
