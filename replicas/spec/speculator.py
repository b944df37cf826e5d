"""Which sequences get drafts in a step, and how many; what came of them (the stats).

Before each schedule the engine asks for drafts for its running sequences; the scheduler
schedules them after each sequence's last token, one step verifies them all
(`replicas/execution/verify.py`), and the engine appends the accepted run and the token that
follows it. A draft costs a row of compute and pays only if it is accepted often enough:

- never in a step with more running sequences than `disable_by_batch_size`, past a request's
  `max_tokens` or the model's length, or for a sequence that needs every position's hidden state
  (pooling);
- the acceptance a draft needs is the cost of its row over the cost of a token at the current
  batch size, read off the engine's own steps: a step costs a fixed part (reading the weights,
  its own Python) and a part per row. At batch 1 a row is a small share of a step and a draft
  pays even when it is rarely right; in a large batch on a CPU a row costs nearly a token's share
  and only drafts that are nearly always right pay;
- a sequence whose recent acceptance rate falls below that, or whose last drafts were all
  rejected, gets none for a while (the wait doubles with each such verdict; a run that pays ends
  it), and with several sequences running each gets only as many drafts as its rate expects to
  be accepted.
"""
from __future__ import annotations

from pagedserve.replicas.config import SpeculativeConfig
from pagedserve.replicas.core.sequence import Sequence
from pagedserve.replicas.execution.penalties import stop_token_ids
from pagedserve.replicas.spec.ngram import NgramProposer
from pagedserve.replicas.spec.suffix import SuffixProposer

# disable_by_batch_size's default: a cap on the verify rows one step can add; within it the
# acceptance rule decides (bench/speculative.py measures both).
DEFAULT_MAX_BATCH = 32
# Until the engine has timed a step of several rows, the acceptance a draft needs in a batch of
# more than SMALL_BATCH sequences (none at or below it).
SMALL_BATCH = 2
PRIOR_MIN_ACCEPTANCE = 0.5
ACCEPTANCE_WEIGHT = 0.3  # the weight of the latest verify run in a sequence's recent rate
ENGINE_RATE_WEIGHT = 0.05  # ... and in the engine's, over every sequence
ROW_COST_WEIGHT = 0.05  # the weight of the latest step in the per-row cost's running mean
MAX_BACKOFF_STEPS = 64  # the longest a sequence whose drafts keep missing goes without


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.max_batch = config.disable_by_batch_size or DEFAULT_MAX_BATCH
        self.batch_size = 0  # running sequences at the last proposal
        if config.method == "suffix":
            self.proposer = SuffixProposer(
                config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob)
        else:
            self.proposer = NgramProposer(config.num_speculative_tokens,
                                          config.prompt_lookup_min, config.prompt_lookup_max)
        # A proposer that learns from every output (suffix) sees each step's tokens, drafts or not.
        self._observe = getattr(self.proposer, "observe", None)
        self._backoff: dict[int, tuple[int, int]] = {}  # seq_id -> (steps left, next wait)
        self._acceptance: dict[int, float] = {}  # seq_id -> its recent acceptance rate
        # Every sequence's, the start of a new one's: what drafts have been worth lately here.
        self._engine_rate = 1.0
        self._row_s: float | None = None  # a step's cost per row beyond its first
        self._light_s: float | None = None  # a step of one row
        # Counters, as vLLM's spec-decode metrics name them.
        self.num_drafts = 0  # verify runs: a sequence with drafts in a step
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's spec_token_ids for the next step (most get none)."""
        self.batch_size = len(running)
        if len(running) > self.max_batch:
            for seq in running:
                seq.spec_token_ids = []
                if self._observe is not None and seq.num_computed_tokens == seq.num_tokens - 1:
                    self._observe(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
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
            if self._observe is not None:
                self._observe(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
            return []
        # One more token always follows the accepted drafts: leave room for it.
        room = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - num) - 1
        if self.batch_size > SMALL_BATCH:  # as many drafts as its rate expects to be accepted
            rate = self._acceptance.get(seq.seq_id, self._engine_rate)
            room = min(room, max(1, round(rate * self.config.num_speculative_tokens)))
        drafts = self.proposer.propose(seq.seq_id, seq.token_ids, room, seq.num_prompt_tokens)
        if drafts and seq.grammar is not None:
            # Only drafts the grammar allows can be accepted, and none past an end of text: a
            # grammar that has ended takes no more tokens (the verify step samples the end).
            ends = stop_token_ids(seq)
            drafts = drafts[:next((i for i, t in enumerate(drafts) if t in ends), len(drafts))]
            drafts = drafts[:seq.grammar.num_allowed(drafts)]
        return drafts

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verify run's outcome: num_accepted of its num_drafts drafts were taken."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        accepted = num_accepted / num_drafts
        rate = self._acceptance.get(seq.seq_id, self._engine_rate)
        rate += ACCEPTANCE_WEIGHT * (accepted - rate)
        self._acceptance[seq.seq_id] = rate
        self._engine_rate += ENGINE_RATE_WEIGHT * (accepted - self._engine_rate)
        if num_accepted and rate >= self.min_acceptance(self.batch_size):
            self._backoff.pop(seq.seq_id, None)
        else:
            _, wait = self._backoff.get(seq.seq_id, (0, 1))
            self._backoff[seq.seq_id] = (wait, min(2 * wait, MAX_BACKOFF_STEPS))

    def observe_step(self, step_s: float, num_rows: int, light_s: float | None) -> None:
        """A step's wall time and rows; light_s: a one-row step's (the engine's StepLoad)."""
        if light_s is None or num_rows < 2:
            return
        per_row = max(0.0, (step_s - light_s) / (num_rows - 1))
        row = self._row_s
        self._row_s = per_row if row is None else row + ROW_COST_WEIGHT * (per_row - row)
        self._light_s = light_s

    def min_acceptance(self, batch_size: int) -> float:
        """The acceptance rate at which a draft row pays for itself in a step of batch_size
        sequences: its cost over what a token costs in a plain step of that batch."""
        row, light = self._row_s, self._light_s
        if row is None or light is None:
            return 0.0 if batch_size <= SMALL_BATCH else PRIOR_MIN_ACCEPTANCE
        fixed = max(light - row, 0.0)
        return batch_size * row / (fixed + batch_size * row) if row > 0 else 0.0

    def release(self, seq: Sequence) -> None:
        """A sequence ended (a proposer that learns from outputs takes in its last tokens)."""
        seq_id = seq.seq_id
        self.proposer.release(seq_id, seq.token_ids, seq.num_prompt_tokens)
        self._backoff.pop(seq_id, None)
        self._acceptance.pop(seq_id, None)

    def stats(self) -> dict:
        drafts, tokens = self.num_drafts, self.num_draft_tokens
        return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_acceptance_rate": self.num_accepted_tokens / tokens if tokens else 0.0,
                # tokens a verify run yields: its accepted drafts and the one that follows
                "spec_decode_mean_accepted_length": 1 + self.num_accepted_tokens / drafts
                if drafts else 0.0,
                "spec_decode_accepted_per_position": list(self.accepted_per_position)}
