"""The request streams: Poisson arrivals at a rate that changes over time, and prompts named by
block hashes (consecutive integers from one counter: chained hashes never collide, and these
cannot either).

- llmd: the llm-d benchmark's shape: tenants with a long shared context, users sending unique
  queries after it; the rate rises in equal steps up to `rate`.
- chat: multi-turn sessions; each turn's prompt is the previous prompt, its answer and a new user
  message, so it extends the previous turn's blocks.
- nosharing: unique prompts: nothing to gain from affinity.
- diurnal: the llmd prompts under a day-shaped rate curve (one "day" per run), for autoscaling.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench.fleet.replica import Request

WORKLOADS = ("llmd", "chat", "nosharing", "diurnal")


@dataclass
class WorkloadSettings:
    rate: float  # requests/s: the top of the ramp, or the peak of the day
    duration_s: float
    block_size: int = 16
    num_stages: int = 5  # load steps of the ramp
    num_tenants: int = 150
    context_tokens: int = 6000
    users_per_tenant: int = 5
    query_tokens: int = 1200
    output_tokens: int = 128
    nosharing_prompt_tokens: int = 2000
    chat_system_tokens: int = 1000
    chat_user_tokens: int = 200
    chat_turns: int = 6
    chat_think_s: float = 10.0
    diurnal_min_fraction: float = 0.1  # the night's rate, as a fraction of the peak


class Workload:
    def __init__(self, name: str, settings: WorkloadSettings, seed: int):
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}: use one of {WORKLOADS}")
        self.name = name
        self.settings = settings
        self.rng = random.Random(seed)
        self._next_hash = itertools.count(1 << 40)
        self._ids = itertools.count()

    # -- the rate over time ---------------------------------------------------------------------
    def stage_of(self, t: float) -> int:
        s = self.settings
        if self.name == "diurnal":
            return 0
        return min(int(t * s.num_stages / s.duration_s), s.num_stages - 1)

    def stage_rates(self) -> list[float]:
        s = self.settings
        if self.name == "diurnal":
            return [s.rate]
        return [s.rate * (i + 1) / s.num_stages for i in range(s.num_stages)]

    def rate_at(self, t: float) -> float:
        s = self.settings
        if self.name == "diurnal":
            low = s.diurnal_min_fraction
            return s.rate * (low + (1 - low) * (1 - math.cos(2 * math.pi * t / s.duration_s)) / 2)
        return self.stage_rates()[self.stage_of(t)]

    def arrivals(self, rate_at: Callable[[float], float], peak: float) -> Iterator[float]:
        """A Poisson process of rate rate_at(t) <= peak, by thinning."""
        t = 0.0
        while True:
            t += self.rng.expovariate(peak)
            if t >= self.settings.duration_s:
                return
            if self.rng.random() * peak <= rate_at(t):
                yield t

    # -- the requests ---------------------------------------------------------------------------
    def requests(self) -> Iterator[Request]:
        if self.name == "chat":
            return self._chat()
        return self._single_turn()

    def _hashes(self, num: int) -> list[int]:
        return list(itertools.islice(self._next_hash, num))

    def _request(self, t: float, num_prompt_tokens: int, max_tokens: int,
                 block_hashes: list[int]) -> Request:
        return Request(f"r{next(self._ids)}", t, num_prompt_tokens, max_tokens, block_hashes,
                       self.stage_of(t))

    def _single_turn(self) -> Iterator[Request]:
        s = self.settings
        bs = s.block_size
        contexts = [self._hashes(s.context_tokens // bs) for _ in range(s.num_tenants)]
        peak = max(self.stage_rates())
        for t in self.arrivals(self.rate_at, peak):
            if self.name == "nosharing":
                num_prompt = s.nosharing_prompt_tokens
                hashes = self._hashes((num_prompt + s.output_tokens) // bs)
            else:
                # Users are spread evenly over tenants; each query is its own. The context is a
                # whole number of blocks, so the query starts on a block edge.
                user = self.rng.randrange(s.num_tenants * s.users_per_tenant)
                context = contexts[user // s.users_per_tenant]
                num_prompt = len(context) * bs + s.query_tokens
                tail = (num_prompt + s.output_tokens) // bs - len(context)
                hashes = context + self._hashes(tail)
            yield self._request(t, num_prompt, s.output_tokens, hashes)

    def _chat(self) -> Iterator[Request]:
        """Sessions start at rate / turns; turn k+1 comes a think time after turn k arrives."""
        s = self.settings
        bs = s.block_size
        pending: list[tuple[float, int, int, int, list[int]]] = []  # (t, order, turn, prompt, hashes)
        order = itertools.count()
        starts = self.arrivals(lambda t: self.rate_at(t) / s.chat_turns,
                               max(self.stage_rates()) / s.chat_turns)
        next_start = next(starts, None)
        while next_start is not None or pending:
            if next_start is not None and (not pending or next_start <= pending[0][0]):
                # A session's blocks, all turns included, drawn once.
                total = s.chat_system_tokens + s.chat_turns * (s.chat_user_tokens + s.output_tokens)
                heapq.heappush(pending, (next_start, next(order), 0, s.chat_system_tokens
                                         + s.chat_user_tokens, self._hashes(total // bs)))
                next_start = next(starts, None)
                continue
            t, _, turn, num_prompt, session = heapq.heappop(pending)
            yield self._request(t, num_prompt, s.output_tokens,
                                session[:(num_prompt + s.output_tokens) // bs])
            follow = t + self.rng.expovariate(1 / s.chat_think_s)
            if turn + 1 < s.chat_turns and follow < s.duration_s:
                heapq.heappush(pending, (follow, next(order), turn + 1,
                                         num_prompt + s.output_tokens + s.chat_user_tokens, session))
