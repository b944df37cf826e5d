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
3. Fallback: power of two choices on load.

Ties between equally good replicas go to the lower load, then to the rendezvous winner, so
decisions are deterministic (except the random pair of the fallback) and the same in every router.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

AFFINITY = "affinity"
LOAD_OVERRIDE = "load-override"
COLD_HOME = "cold-home"
FALLBACK = "fallback"
REASONS = (AFFINITY, LOAD_OVERRIDE, COLD_HOME, FALLBACK)


class RoutingSettings(BaseModel):
    """The router's named thresholds (`request_router_kwargs` of the replica deployment)."""

    model_config = ConfigDict(extra="forbid")

    # Requests (waiting + running) by which the best cache holder may exceed the least-loaded replica.
    load_override_threshold: float = Field(4.0, ge=0)
    # The same guard for a cold prefix's home; lower, since nothing is cached there yet.
    cold_home_max_excess_load: float = Field(2.0, ge=0)
    # Leading blocks a replica must hold beyond the replica holding the fewest for affinity to count.
    min_affinity_blocks: int = Field(1, ge=1)
    # Blocks past the part every replica holds that name a cold prefix's home.
    cold_home_blocks: int = Field(1, ge=1)
    # How long an optimistic insert outlives the digests taken after it (see PrefixIndex).
    optimistic_ttl_s: float = Field(10.0, gt=0)


@dataclass(slots=True, frozen=True)
class Decision:
    ranked: list[str]  # replica ids, most preferred first; every live replica appears once
    reason: str
    num_matched_blocks: int  # leading blocks of the request the first choice holds

    @property
    def replica_id(self) -> str:
        return self.ranked[0]


def rendezvous_weight(key: int, replica_id: str) -> int:
    """Highest-random-weight hashing; stable across processes (Python's str hash is salted)."""
    data = key.to_bytes(8, "little", signed=True) + replica_id.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def rendezvous_home(key: int, replica_ids: Sequence[str]) -> str:
    return max(replica_ids, key=lambda r: rendezvous_weight(key, r))


def choose_replica(block_hashes: Sequence[int], loads: Mapping[str, float],
                   matches: Mapping[str, int], settings: RoutingSettings,
                   rng: random.Random | None = None) -> Decision:
    """Rank the live replicas (the keys of `loads`) for one request."""
    if not loads:
        raise ValueError("no live replicas to choose from")
    ids = sorted(loads)
    matched = {r: matches.get(r, 0) for r in ids}
    least = min(loads.values())
    best = max(matched.values())
    common = min(matched.values())
    num_blocks = len(block_hashes)
    # Ties between holders, and a cold prefix's home, are keyed on the first blocks past the part
    # every replica holds, so requests that agree on those blocks agree on the replica.
    key = block_hashes[min(common + settings.cold_home_blocks, num_blocks) - 1] if num_blocks else 0
    weight = {r: rendezvous_weight(key, r) for r in ids}

    def rank(first: str) -> list[str]:
        rest = sorted((r for r in ids if r != first), key=lambda r: (-matched[r], loads[r], -weight[r]))
        return [first, *rest]

    if best - common >= settings.min_affinity_blocks:
        eligible = [r for r in ids if loads[r] - least <= settings.load_override_threshold]
        pick = max(eligible, key=lambda r: (matched[r], -loads[r], weight[r]))
        reason = AFFINITY if matched[pick] == best else LOAD_OVERRIDE
        return Decision(rank(pick), reason, matched[pick])

    if num_blocks:
        home = max(ids, key=lambda r: weight[r])
        if loads[home] - least <= settings.cold_home_max_excess_load:
            return Decision(rank(home), COLD_HOME, matched[home])

    pick = power_of_two_choices(ids, loads, rng or random)
    return Decision(rank(pick), FALLBACK, matched[pick])


def power_of_two_choices(ids: Sequence[str], loads: Mapping[str, float], rng) -> str:
    if len(ids) == 1:
        return ids[0]
    a, b = rng.sample(list(ids), 2)
    if loads[a] == loads[b]:
        return a
    return a if loads[a] < loads[b] else b
