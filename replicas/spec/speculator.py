"""Which sequences get drafts in a step, and how many; what came of them (the stats).

Before each schedule the engine asks for drafts for its running sequences; the scheduler
schedules them after each sequence's last token, one step verifies them all
(`replicas/execution/verify.py`), and the engine appends the accepted run and the token that
follows it. A draft costs a row of compute, so drafts are proposed only where they are likely to
pay: never in a step with more running sequences than `disable_by_batch_size`, never past a
request's `max_tokens` or the model's length, never for a sequence that needs every position's
hidden state (pooling), and, for a sequence whose last drafts were all rejected, not again for a
while (the wait doubles with each such miss, and one accepted draft ends it).
"""
from __future__ import annotations

from pagedserve.replicas.config import SpeculativeConfig
from pagedserve.replicas.core.sequence import Sequence
from pagedserve.replicas.spec.ngram import NgramProposer

# disable_by_batch_size's default on CPU. A verify row costs about what a decode row does there
# (the GEMMs are compute bound past a few rows), so drafts pay only while the batch is small and
# most of a step is reading the weights; bench/speculative.py measures the turn-off point.
CPU_MAX_BATCH = 4
# On a GPU a step is bound by reading the weights until far larger batches.
GPU_MAX_BATCH = 32
MAX_BACKOFF_STEPS = 64  # the longest a sequence whose drafts keep missing goes without


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, on_cpu: bool = True):
        self.config = config
        self.max_model_len = max_model_len
        self.max_batch = config.disable_by_batch_size or (
            CPU_MAX_BATCH if on_cpu else GPU_MAX_BATCH)
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self._backoff: dict[int, tuple[int, int]] = {}  # seq_id -> (steps left, next wait)
        # Counters, as vLLM's spec-decode metrics name them.
        self.num_drafts = 0  # verify runs: a sequence with drafts in a step
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's spec_token_ids for the next step (most get none)."""
        if len(running) > self.max_batch:
            for seq in running:
                seq.spec_token_ids = []
            return
        for seq in running:
            seq.spec_token_ids = self._drafts(seq)

    def _drafts(self, seq: Sequence) -> list[int]:
        num = seq.num_tokens
        if seq.num_computed_tokens != num - 1:  # still prefilling (or recomputing)
            return []
        params = seq.sampling_params
        if params.pooling is not None:
            return []
        wait = self._backoff.get(seq.seq_id)
        if wait is not None and wait[0] > 0:
            self._backoff[seq.seq_id] = (wait[0] - 1, wait[1])
            return []
        # One more token always follows the accepted drafts: leave room for it.
        room = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - num) - 1
        if room <= 0:
            return []
        drafts = self.proposer.propose(seq.seq_id, seq.token_ids, room)
        if drafts and seq.grammar is not None:  # only drafts the grammar allows can be accepted
            drafts = drafts[:seq.grammar.matcher.validate_tokens(drafts)]
        return drafts

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verify run's outcome: num_accepted of its num_drafts drafts were taken."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        if num_accepted:
            self._backoff.pop(seq.seq_id, None)
        else:
            _, wait = self._backoff.get(seq.seq_id, (0, 1))
            self._backoff[seq.seq_id] = (wait, min(2 * wait, MAX_BACKOFF_STEPS))

    def release(self, seq_id: int) -> None:
        self.proposer.release(seq_id)
        self._backoff.pop(seq_id, None)

    def stats(self) -> dict:
        drafts, tokens = self.num_drafts, self.num_draft_tokens
        return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": self.num_accepted_tokens / tokens if tokens else 0.0,
                # tokens a verify run yields: its accepted drafts and the one that follows
                "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / drafts
                if drafts else 0.0,
                "spec_decode_accepted_per_position": list(self.accepted_per_position)}
