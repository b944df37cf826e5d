"""One generated sequence: its tokens, its progress, its blocks. Pure Python."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.replicas.core.block_hash import hash_block
from pagedserve.replicas.core.lora_request import adapter_root_hash
from pagedserve.replicas.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED


# Built once: naming the members inside is_finished cost more than the test (several times
# per token in the engine's loop).
FINISHED = (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED)

_seq_ids = itertools.count()


class OutputTokens:
    """A sequence's outputs as its token ids past the prompt: a Sequence's, and those of the
    sampler's views of one (replicas/execution/verify.py's DraftPosition)."""

    __slots__ = ()
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(eq=False)
class Sequence(OutputTokens):
    """A request has `n` of these; each catches `num_computed_tokens` up to `num_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_size: int
    index: int = 0  # which of the request's n samples
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first schedule
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks so far
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the cache
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Its GrammarMatcher under structured outputs, else None; the control plane only carries it.
    grammar: Any = field(default=None, repr=False)
    priority: int = 0  # under the priority policy: lower is served first
    lora_id: int = 0  # its LoRA adapter's lora_int_id; 0: the base model
    # Drafts proposed for its next step (speculative decoding), consumed when it is scheduled.
    spec_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def schedule_key(self) -> tuple[int, float, int]:
        """The priority policy's order: priority, then arrival (first come first served)."""
        return (self.priority, self.arrival_time, self.seq_id)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @property
    def sample_seed(self) -> int | None:
        seed = self.sampling_params.seed
        return None if seed is None else seed + self.index

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self._extend_hashes()

    def block_tokens(self, block_index: int) -> list[int]:
        start = block_index * self.block_size
        return self.token_ids[start:start + self.block_size]

    def prefix_tokens(self, num_blocks: int) -> list[int]:
        """The tokens of the first num_blocks blocks: their block_tokens end to end."""
        return self.token_ids[:num_blocks * self.block_size]

    def _extend_hashes(self) -> None:
        parent = self.block_hashes[-1] if self.block_hashes else adapter_root_hash(self.lora_id)
        for i in range(len(self.block_hashes), self.num_tokens // self.block_size):
            parent = hash_block(parent, self.block_tokens(i))
            self.block_hashes.append(parent)
