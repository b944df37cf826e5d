"""Token-centric continuous batching: every step, each sequence catches num_computed_tokens up
toward num_tokens under one token budget. Prefill, chunked prefill, prefix-cache hits and decode
are the same rule. Preemption is by recompute. Pure Python.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.core.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # num_computed_tokens before this step: first position computed now
    num_new_tokens: int  # its drafts included
    # Drafts run after its last token (speculative decoding): the step verifies them.
    spec_token_ids: list[int] = ()

    @property
    def samples(self) -> bool:
        """Caught up to its last token, so this step yields its next token(s)."""
        return self.start + self.num_new_tokens - len(self.spec_token_ids) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """The handoff to the model runner. The runner reads it and never mutates scheduler state."""
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences this step samples a token for: the runner's outputs follow this order."""
        return [s.seq for s in self.scheduled if s.samples]

    def seq(self, seq_id: int) -> Sequence:
        return next(s.seq for s in self.scheduled if s.seq.seq_id == seq_id)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# fcfs: arrival order. priority: each sequence's (priority, arrival) order, lowest first, both
# for admission and (reversed) for picking whom to preempt, as vLLM's policies do.
SCHEDULING_POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, policy: str = "fcfs",
                 max_loras: int | None = None):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}: use one of {SCHEDULING_POLICIES}")
        self.policy = policy
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras  # distinct LoRA adapters among the running sequences, at most
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prefill_tokens(self) -> int:
        """Tokens still to prefill before the unfinished sequences decode: what a new prompt's
        first token waits behind. A waiting sequence's whole context (a preempted one's outputs
        too) less its prefix-cache hit, once admission has found it; a running one's prompt. A
        step's outputs carry it, so it reads no more than a field or two of each sequence (a
        running sequence past its prompt decodes, but for the rare one recomputing its outputs
        after a preemption, which is left out)."""
        total = 0
        for seq in self.waiting:
            computed, cached = seq.num_computed_tokens, seq.num_cached_tokens
            behind = seq.num_tokens - 1 - (computed if computed > cached else cached)
            if behind > 0:
                total += behind
        for seq in self.running:
            behind = seq.num_prompt_tokens - 1 - seq.num_computed_tokens
            if behind > 0:
                total += behind
        return total

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.policy == "priority":
            self._insert_waiting(seq)
        else:
            self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Running sequences first, oldest (most urgent) first; the youngest (least urgent) is
        # preempted when blocks run out.
        if self.policy == "priority":
            self.running.sort(key=Sequence.schedule_key.fget)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add_scheduled(out, seq, num_new)
                budget -= num_new
                i += 1
                continue
            break
        # Admit waiting sequences in policy order, unless this step had to preempt. One whose
        # adapter would be one too many waits for a slot; those behind it may still go.
        loras = {s.lora_id for s in self.running if s.lora_id} if self.max_loras else set()
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.max_loras and seq.lora_id and seq.lora_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_cached = [], 0
            params = seq.sampling_params
            # Prompt logprobs and pooling need every position's hidden state: no cache hits.
            if params.prompt_logprobs is None and params.pooling is None:
                computed_blocks, num_cached = self.block_manager.get_computed_blocks(seq)
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate_slots(seq, num_new, computed_blocks):
                break
            self.block_manager.record_lookup(seq, num_cached)
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_cached
            self._add_scheduled(out, seq, num_new)
            budget -= num_new
            if self.max_loras and seq.lora_id:
                loras.add(seq.lora_id)
        self.waiting.extendleft(reversed(skipped))
        if budget > 0:
            self._schedule_drafts(out, budget)
        return out

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Drafts (speculative decoding) run after their sequence's last token, with what the
        step's real tokens left of the budget and the free blocks: they never cost another
        sequence a token, a prefill chunk or its blocks."""
        for item in out.scheduled:
            seq = item.seq
            spec = seq.spec_token_ids
            if not spec:
                continue
            seq.spec_token_ids = []
            if budget <= 0 or not item.samples:
                continue
            end = item.start + item.num_new_tokens
            # Without blocks to spare, only as many as its last block has room for.
            room = len(seq.block_table) * self.block_manager.block_size - end
            spec = spec[:budget] if self.block_manager.num_free_blocks else spec[:min(budget, room)]
            # Asked as one allocation from the step's first position, as its real tokens were
            # (a sliding window's blocks are released from there).
            seq.num_computed_tokens = item.start
            fits = bool(spec) and self.block_manager.allocate_slots(seq, end - item.start + len(spec))
            if not fits and 0 < room < len(spec):
                spec = spec[:room]
                fits = self.block_manager.allocate_slots(seq, end - item.start + len(spec))
            seq.num_computed_tokens = end
            if not fits:
                continue
            item.spec_token_ids = spec
            item.num_new_tokens += len(spec)
            seq.num_computed_tokens += len(spec)
            budget -= len(spec)

    def update(self, out: SchedulerOutput, sampled_token_ids: list[list[int]]) -> list[Sequence]:
        """Append each sampling sequence's new tokens, up to one that ends it.

        sampled_token_ids has one list per sequence of `out.sampling`, in order (one token, or
        a verified run: accepted drafts and the token after them); returns those sequences.
        """
        sampling = out.sampling
        for seq, token_ids in zip(sampling, sampled_token_ids, strict=True):
            for token_id in token_ids:
                if not self.append_token(seq, token_id):
                    break
            self.end_step(seq)
        return sampling

    def append_token(self, seq: Sequence, token_id: int) -> bool:
        """Append one sampled token; finish seq if it meets a stop condition. Whether it runs on."""
        seq.append_token(token_id)
        status = self._check_stop(seq, token_id)
        if status is not None:
            self.finish(seq, status)
            return False
        return True

    @staticmethod
    def end_step(seq: Sequence) -> None:
        """After a sampling step's tokens are appended: the KV of rejected drafts (positions from
        the last token on) no longer counts as computed; the next tokens overwrite it."""
        if seq.num_computed_tokens >= seq.num_tokens:
            seq.num_computed_tokens = seq.num_tokens - 1

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
        seq.num_computed_tokens += num_new

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.policy == "priority":
            self._insert_waiting(seq)
        else:
            self.waiting.appendleft(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        key = seq.schedule_key
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].schedule_key > key:  # usually at the end
            index -= 1
        self.waiting.insert(index, seq)

    def _check_stop(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in params.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None
