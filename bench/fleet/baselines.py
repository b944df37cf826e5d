"""Routers to beat, in the same simulator: random, round-robin, power of two choices on queue
length (Ray Serve's default), and an approximate prefix router that guesses from what it routed.

Each keeps its own count of the requests it has in flight per replica, as Ray Serve's router
does, and returns a ranked list of replicas; the fleet sends to the first with room.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping

from bench.fleet.replica import Request


class _LocalLoad:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.in_flight: dict[str, int] = {}

    def update_replicas(self, digests: Mapping[str, dict]) -> None:
        pass

    def routed(self, request: Request, replica_id: str) -> None:
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def first_token(self, request: Request) -> None:
        pass

    def completed(self, request: Request) -> None:
        self.in_flight[request.replica_id] -= 1

    def load(self, replica_id: str) -> int:
        return self.in_flight.get(replica_id, 0)

    def two_choices(self, live: list[str]) -> list[str]:
        if len(live) == 1:
            return list(live)
        a, b = self.rng.sample(live, 2)
        return [a, b] if self.load(a) <= self.load(b) else [b, a]


class RandomRouter(_LocalLoad):
    name = "random"

    def choose(self, request: Request, live: list[str]) -> list[str]:
        return [self.rng.choice(live)]


class RoundRobinRouter(_LocalLoad):
    name = "roundrobin"

    def __init__(self, seed: int):
        super().__init__(seed)
        self.next = 0

    def choose(self, request: Request, live: list[str]) -> list[str]:
        self.next += 1
        return [live[self.next % len(live)]]


class PowerOfTwoRouter(_LocalLoad):
    name = "p2c"

    def choose(self, request: Request, live: list[str]) -> list[str]:
        return self.two_choices(live)


class ApproxPrefixRouter(_LocalLoad):
    """What Ray Serve LLM's PrefixCacheAffinityRouter and SGLang's cache-aware router do: a tree
    of the prompts each replica was sent (never what it evicted), bounded per replica by LRU.
    A block-hash chain stands for the text: a node is a prefix, at block granularity. Defaults
    are Ray's: load imbalance over `imbalanced_threshold` -> power of two choices; else a match
    rate of at least `match_rate_threshold` -> the longest match; else the smallest tree."""

    name = "approx"

    def __init__(self, seed: int, max_tree_blocks: int, block_size: int,
                 imbalanced_threshold: int = 10, match_rate_threshold: float = 0.1):
        super().__init__(seed)
        self.block_size = block_size
        self.max_tree_blocks = max_tree_blocks
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.tree: dict[int, set[str]] = {}  # prefix -> replicas it was sent to
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def choose(self, request: Request, live: list[str]) -> list[str]:
        loads = [self.load(r) for r in live]
        if max(loads) - min(loads) > self.imbalanced_threshold:
            return self.two_choices(live)
        hashes = request.block_hashes
        holders: set[str] | None = None
        matched = 0
        for block_hash in hashes:
            found = self.tree.get(block_hash)
            narrowed = found if holders is None else (holders & found if found else None)
            if not narrowed:
                break
            holders, matched = narrowed, matched + 1
        if holders and matched / len(hashes) >= self.match_rate_threshold:
            candidates = [r for r in live if r in holders]
            if candidates:
                return sorted(candidates, key=self.load)
        smallest = min(len(self.lru.get(r, ())) for r in live)
        return sorted((r for r in live if len(self.lru.get(r, ())) == smallest), key=self.load)

    def routed(self, request: Request, replica_id: str) -> None:
        super().routed(request, replica_id)
        lru = self.lru.setdefault(replica_id, OrderedDict())
        limit = request.num_prompt_tokens // self.block_size
        for block_hash in request.block_hashes[:limit]:
            self.tree.setdefault(block_hash, set()).add(replica_id)
            lru[block_hash] = None
            lru.move_to_end(block_hash)
        while len(lru) > self.max_tree_blocks:
            old, _ = lru.popitem(last=False)
            owners = self.tree.get(old)
            if owners is not None:
                owners.discard(replica_id)
                if not owners:
                    del self.tree[old]

