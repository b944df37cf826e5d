"""A model of one engine replica: the real `Scheduler` and `BlockManager` over sequences that
carry block hashes instead of tokens, stepped in simulated time by a `CostModel`, and reporting
through the real `RoutingReporter` (KV-event stream included) and `autoscaling_stats`.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from bench.fleet.clock import EventQueue
from bench.fleet.cost_model import CostModel
from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.core.cache_digest import (RoutingReporter, StepReport, autoscaling_inputs,
                                   autoscaling_stats, step_report)
from pagedserve.replicas.core.scheduler import Scheduler
from pagedserve.replicas.core.sequence import SequenceStatus
from pagedserve.replicas.core.step_load import StepLoad

_seq_ids = itertools.count()


@dataclass(slots=True)
class Request:
    """One simulated request. `block_hashes` names every full block of the prompt and of the
    output it will generate (a multi-turn chat's next turn shares them); `text` is what a
    text-matching router sees: one symbol per block."""
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    block_hashes: list[int]
    stage: int = 0  # the load step it arrived in
    first_token_s: float | None = None
    finish_s: float | None = None
    num_cached_tokens: int = 0
    replica_id: str | None = None
    rejected: bool = False


class SimSequence:
    """What `Scheduler` and `BlockManager` read of a `pagedserve.replicas.core.sequence.Sequence`, without tokens:
    a block's "tokens" are its hash, so the block manager's token re-check on a hit still runs.
    It is its own sampling params (greedy, ignore_eos, `max_tokens` from the request)."""

    __slots__ = ("request", "seq_id", "status", "num_prompt_tokens", "num_output_tokens",
                 "num_computed_tokens", "num_cached_tokens", "block_table", "block_hashes",
                 "num_registered_blocks", "num_preemptions", "max_tokens", "arrival_time")
    prompt_logprobs = None
    pooling = None
    min_tokens = 0
    stop_token_ids = ()
    eos_token_ids = ()
    ignore_eos = True
    priority = 0
    spec_token_ids = ()  # the simulated engine proposes no drafts

    def __init__(self, request: Request, block_size: int):
        self.request = request
        self.seq_id = next(_seq_ids)
        self.status = SequenceStatus.WAITING
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.block_table: list[int] = []
        self.block_hashes = request.block_hashes
        self.num_registered_blocks = 0
        self.num_preemptions = 0
        self.max_tokens = request.max_tokens
        self.arrival_time = request.arrival_s

    @property
    def sampling_params(self):
        return self

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def schedule_key(self) -> tuple[int, float, int]:
        return (0, self.arrival_time, self.seq_id)

    def append_token(self, token_id: int) -> None:
        self.num_output_tokens += 1

    def block_tokens(self, block_index: int) -> tuple[int]:
        return (self.block_hashes[block_index],)

    def prefix_tokens(self, num_blocks: int) -> list[int]:
        return self.block_hashes[:num_blocks]


@dataclass
class ReplicaSettings:
    num_blocks: int = 25_000  # an H100's worth for an 8B model: ~400k tokens
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 1 << 20


class SimReplica:
    """Steps itself on `queue` while it has work. Callbacks: on_first_token(request) and
    on_finish(request), at the simulated time they happen; on_outputs(replica, sequences) first,
    with every sequence that sampled a token in the step (its outputs leave for the ingresses
    then, with the step's report: `step_report`)."""

    def __init__(self, replica_id: str, settings: ReplicaSettings, cost_model: CostModel,
                 queue: EventQueue, on_first_token: Callable[[Request], None],
                 on_finish: Callable[[Request], None],
                 on_outputs: Callable[["SimReplica", list], None] | None = None):
        self.replica_id = replica_id
        self.settings = settings
        self.cost_model = cost_model
        self.queue = queue
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        self.on_outputs = on_outputs
        self.block_manager = BlockManager(settings.num_blocks, settings.block_size)
        self.scheduler = Scheduler(self.block_manager, settings.max_num_seqs,
                                   settings.max_num_batched_tokens, settings.max_model_len)
        self.engine = self  # RoutingReporter reads `.engine.block_manager`
        self.reporter = RoutingReporter(self, wall_clock=queue, clock=queue)
        self.busy = False
        self.num_steps = 0
        self.busy_s = 0.0
        self.step_load = StepLoad()
        self.num_output_tokens = 0
        self.num_arrived = 0
        self.last_generation_time: float | None = None

    # -- what the engine's AsyncEngine offers its deployment ----------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {"num_waiting": self.scheduler.num_waiting, "num_running": self.scheduler.num_running,
                "max_num_seqs": self.settings.max_num_seqs, "num_arrived": self.num_arrived,
                "kv_cache_usage": bm.usage, "prefix_cache_hit_rate": bm.hit_rate,
                **autoscaling_inputs(bm, self.step_load, self.queue.now),
                "last_generation_time": self.last_generation_time}

    def record_routing_stats(self) -> dict:
        return self.reporter.report()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return autoscaling_stats(self.stats())

    def step_report(self) -> StepReport:
        """What a step's outputs carry to the ingresses' routers, as the engine core's do."""
        return step_report(self, now=self.queue.now)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @property
    def num_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    # -- the loop -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.replica_id = self.replica_id
        self.num_arrived += 1
        self.scheduler.add(SimSequence(request, self.settings.block_size))
        if not self.busy:
            self.busy = True
            self.queue.after(0.0, self._step)

    def _step(self) -> None:
        out = self.scheduler.schedule()
        if out.is_empty:
            self.busy = False
            return
        num_prefill = num_decode = 0
        for scheduled in out.scheduled:
            if scheduled.start < scheduled.seq.num_prompt_tokens:
                num_prefill += scheduled.num_new_tokens
            else:
                num_decode += 1
        duration = self.cost_model.step_time(num_prefill, num_decode)
        self.busy_s += duration
        num_tokens = num_prefill + num_decode
        self.queue.after(duration, lambda: self._finish_step(out, duration, num_tokens))

    def _finish_step(self, out, duration: float, num_tokens: int) -> None:
        self.num_steps += 1
        self.step_load.record(self.queue.now, duration, num_tokens)
        sampled = self.scheduler.update(out, [[0]] * len(out.sampling))
        now = self.queue.now
        if sampled:
            self.last_generation_time = now
            self.num_output_tokens += len(sampled)
            if self.on_outputs is not None:
                self.on_outputs(self, sampled)
        for seq in sampled:
            request = seq.request
            if request.first_token_s is None:
                request.first_token_s = now
                request.num_cached_tokens = max(seq.num_cached_tokens, 0)
                self.on_first_token(request)
            if seq.is_finished:
                request.finish_s = now
                self.on_finish(request)
        self._step()
