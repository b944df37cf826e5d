"""The routing choice, as a pure function of the request's block hashes, each replica's load, and
how many leading blocks of the request each replica holds.

1. Affinity. If some replica holds more of the prompt than another (by at least
   `min_affinity_blocks`), go to the one holding the most, unless its load exceeds the least-loaded
   replica's by more than `load_override_threshold`. Then load wins ("load-override"): among the
   replicas within the threshold, the one holding the most of the prompt.
2. Cold home. If no replica holds more than another (often: nobody holds anything), the uncached
   part has a home: the rendezvous hash, over the live replica ids, of the first
   `cold_home_blocks` blocks past the part every replica holds. Repeats of a cold prefix converge
   on one replica instead of spraying, while different prefixes spread over all replicas (no
   "every miss to replica 0" at low load). A home whose load exceeds the least-loaded replica's by
   more than `cold_home_max_excess_load` is skipped: misses never pile onto an overloaded replica.
   With `cold_home_pair_slack` set, the home is one of two choices on load, the other drawn at
   random: a home busier than the other by more than the slack yields to it (off by default).
3. Fallback: power of two choices, on the prompt blocks queued for prefill, then on load. A new
   prompt waits for the prefills queued ahead of it; the request count is mostly decoding
   requests, and chasing its low spots piles new prompts together.

Ties between equally good replicas go to the lower load, then to the rendezvous winner, so
decisions are deterministic (except the random pairs: the fallback's, a cold home's if set) and
the same in every router.

The cost follows the replicas that hold the prompt, not the fleet: what a decision does for every
replica is a few C-level passes (their loads, the least of them, the rendezvous weights of a cold
prefix in numpy). The ranking past the first choice, which Ray reads only when that replica is
full, is sorted when it is first asked for.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pagedserve.serve_app.routing.prefix_index import PrefixMatch
from pagedserve.serve_app.routing.rendezvous import (  # noqa: F401 (re-exported)
    ReplicaSet, rendezvous_home, rendezvous_weight,
)

AFFINITY = "affinity"
LOAD_OVERRIDE = "load-override"
COLD_HOME = "cold-home"
FALLBACK = "fallback"
REASONS = (AFFINITY, LOAD_OVERRIDE, COLD_HOME, FALLBACK)


class RoutingSettings(BaseModel):
    """The router's named thresholds (the `request_router_kwargs` setting; the ingress's router)."""

    model_config = ConfigDict(extra="forbid")

    # Requests (waiting + running) by which the best cache holder may exceed the least-loaded
    # replica. A replica batches many requests at once, so a few more cost less than the prefill
    # a miss repeats; but where replicas outnumber hot prefixes, a high guard piles the load onto
    # their holders while the rest idle. The defaults balance the two at a few replicas and at a
    # thousand (`python -m bench.fleet --workload llmd`).
    load_override_threshold: float = Field(16.0, ge=0)
    # The same guard for a cold prefix's home, lower, since nothing is cached there yet: a home
    # busier than the least-loaded replica by more than this goes to two choices (None: never).
    cold_home_max_excess_load: float | None = Field(8.0, ge=0)
    # Set: a cold home is one of two choices, taken unless another replica drawn at random is less
    # loaded by more than this. None (the default): the home, blind to load within the guard.
    # A slack helped without shared prefixes but cost replicas on the llm-d day, and with the
    # fallback weighing queued prefill the defaults do well on both (bench.fleet --workload
    # nosharing and diurnal).
    cold_home_pair_slack: float | None = Field(None, ge=0)
    # Requests by which the least loaded replica holding a LoRA adapter may exceed the least-loaded
    # replica before the adapter's requests spread to replicas that must load it (a hot adapter
    # spreads; a cold one stays where it is loaded).
    adapter_max_excess_load: float = Field(8.0, ge=0)
    # Leading blocks a replica must hold beyond the replica holding the fewest for affinity to count.
    min_affinity_blocks: int = Field(1, ge=1)
    # Blocks past the part every replica holds that name a cold prefix's home.
    cold_home_blocks: int = Field(1, ge=1)
    # How long an optimistic insert outlives the digests taken after it (see PrefixIndex).
    optimistic_ttl_s: float = Field(10.0, gt=0)
    # False: prefixes are ignored, every request goes to the less loaded of two replicas drawn
    # at random (as Ray Serve's default router does): the baseline routing is measured against.
    prefix_affinity: bool = True


@dataclass(slots=True)
class Decision:
    replica_id: str  # the first choice
    reason: str
    num_matched_blocks: int  # leading blocks of the request the first choice holds
    rest: Callable[[], list[str]] = field(default=list, repr=False, compare=False)
    _rest: list[str] | None = field(default=None, repr=False, compare=False)

    def ranking(self) -> Iterator[str]:
        """Replica ids, most preferred first; every live replica once. Past the first, they are
        ranked when asked for."""
        yield self.replica_id
        if self._rest is None:
            self._rest = self.rest()
        yield from self._rest

    @property
    def ranked(self) -> list[str]:
        return list(self.ranking())


def rank_replicas(block_hashes: Sequence[int], replicas: ReplicaSet, match: PrefixMatch,
                  settings: RoutingSettings, rng: random.Random | None = None,
                  queued_prefill: Mapping[str, int] | None = None) -> Decision:
    """The decision, over `replicas` and their `loads` (and `queued_prefill`) as they are now."""
    ids = replicas.ids
    if not ids:
        raise ValueError("no live replicas to choose from")
    load_list = replicas.loads.copy()  # as of this decision, for the ranking made later
    least = float(load_list.min())
    deeper = match.deeper
    common = match.common if len(deeper) < len(ids) else min(deeper.values())
    best = max(deeper.values(), default=common)
    num_blocks = len(block_hashes)
    # Ties between holders, and a cold prefix's home, are keyed on the first blocks past the part
    # every replica holds, so requests that agree on those blocks agree on the replica.
    key = block_hashes[min(common + settings.cold_home_blocks, num_blocks) - 1] if num_blocks else 0

    def decide(pick: int, reason: str) -> Decision:
        replica_id = ids[pick]
        rest = lambda: _rank_rest(replicas, load_list, common, deeper, key, pick)  # noqa: E731
        return Decision(replica_id, reason, deeper.get(replica_id, common), rest)

    if not settings.prefix_affinity:
        return decide(power_of_two_choices(load_list, rng or random, ids, queued_prefill), FALLBACK)

    if best - common >= settings.min_affinity_blocks:
        # The holders: a few to tens for a hot prefix. Their loads in one gather, as floats; then
        # plain Python, where a dozen numpy calls on arrays this small cost more than the work.
        positions = list(map(replicas.position.__getitem__, deeper))
        threshold = settings.load_override_threshold
        eligible = [(num, load, at) for num, load, at
                    in zip(deeper.values(), load_list[positions].tolist(), positions)
                    if load - least <= threshold]
        if eligible:
            # The most blocks, then the lower load; the rendezvous weight only among those tied.
            most = max(eligible)[0]
            lowest = min(load for num, load, _ in eligible if num == most)
            tied = sorted(at for num, load, at in eligible if num == most and load == lowest)
            pick = tied[0] if len(tied) == 1 else _heaviest(replicas, key, tied)
        else:  # no holder within the threshold: the least-loaded replicas, all with `common`
            pick = _heaviest_least_loaded(replicas, key, load_list, least)
        return decide(pick, AFFINITY if deeper.get(ids[pick], common) == best else LOAD_OVERRIDE)

    if num_blocks:
        home = int(np.argmax(replicas.weights(key)))
        guard = settings.cold_home_max_excess_load
        if guard is None or load_list[home] - least <= guard:
            slack = settings.cold_home_pair_slack
            if slack is None or len(ids) == 1:
                return decide(home, COLD_HOME)
            # Two choices, one of them the home: as good as two random ones where the prompt is
            # never seen again, and the home whenever it is within the slack of the other.
            other = (rng or random).randrange(len(ids) - 1)
            other += other >= home
            if load_list[home] - load_list[other] <= slack:
                return decide(home, COLD_HOME)
            return decide(other, FALLBACK)

    return decide(power_of_two_choices(load_list, rng or random, ids, queued_prefill), FALLBACK)


def _heaviest(replicas: ReplicaSet, key: int, positions) -> int:
    """The first, in `positions` order (ascending), of the heaviest rendezvous weights there."""
    if len(positions) <= 8:  # a few: Python's mix is cheaper than numpy's fixed costs
        return int(max(positions, key=lambda at: replicas.weight(key, at)))
    # Many: a hot prefix's holders, tied request after request on the same key (its first block),
    # so its kept weights are a gather away (mixing their seeds anew cost more).
    positions = np.asarray(positions, dtype=np.intp)
    return int(positions[np.argmax(replicas.kept_weights(key)[positions])])


def _heaviest_least_loaded(replicas: ReplicaSet, key: int, load_list: np.ndarray,
                           least: float) -> int:
    """_heaviest over the replicas whose load is `least` (often hundreds of them): every weight,
    those of the others zeroed, in a few whole-array passes."""
    pick = int(np.argmax(np.where(load_list == least, replicas.kept_weights(key), 0)))
    if load_list[pick] != least:  # every least-loaded weight was 0 (odds ~2^-64): be exact
        return _heaviest(replicas, key, np.flatnonzero(load_list == least))
    return pick


def _rank_rest(replicas: ReplicaSet, load_list: np.ndarray, common: int, deeper: dict[str, int],
               key: int, first: int) -> list[str]:
    """All but the first choice: the most matched blocks first, then lower load, then the
    rendezvous winner."""
    matched = np.full(len(load_list), common, dtype=np.int64)
    for replica_id, num in deeper.items():
        matched[replicas.position[replica_id]] = num
    order = np.lexsort((~replicas.weights(key), load_list, -matched))
    ids = replicas.ids
    return [ids[i] for i in order.tolist() if i != first]


def power_of_two_choices(load_list: Sequence[float], rng, ids: Sequence[str] = (),
                         queued_prefill: Mapping[str, int] | None = None) -> int:
    """Of two distinct replicas drawn at random (positions in `load_list`), the one with fewer
    prompt blocks queued for prefill (by `ids`, where `queued_prefill` is given), then the less
    loaded; the first drawn when they tie."""
    if len(load_list) == 1:
        return 0
    a, b = rng.sample(range(len(load_list)), 2)
    if queued_prefill:
        queued_a, queued_b = queued_prefill.get(ids[a], 0), queued_prefill.get(ids[b], 0)
        if queued_a != queued_b:
            return a if queued_a < queued_b else b
    if load_list[a] == load_list[b]:
        return a
    return a if load_list[a] < load_list[b] else b
