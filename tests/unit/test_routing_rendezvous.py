"""pagedserve.serve_app.routing.rendezvous: the scalar weight and the vectorized one agree, and spread."""
import random
from collections import Counter

import numpy as np
import pytest

from pagedserve.serve_app.routing import rendezvous
from pagedserve.serve_app.routing.rendezvous import ReplicaSet, rendezvous_home, rendezvous_weight


def test_vectorized_weights_equal_the_scalar_weight():
    rng = random.Random(0)
    replicas = ReplicaSet([f"replica-{i:05d}" for i in rng.sample(range(10 ** 5), 300)])
    assert list(replicas.ids) == sorted(replicas.key)
    for key in [0, -1, 1, 2 ** 63 - 1, -(2 ** 63), *(rng.getrandbits(64) - 2 ** 63 for _ in range(20))]:
        weights = replicas.weights(key)
        assert [int(w) for w in weights] == [rendezvous_weight(key, r) for r in replicas.ids]
        assert [replicas.weight(key, i) for i in range(3)] == [int(w) for w in weights[:3]]
        assert replicas.ids[int(weights.argmax())] == rendezvous_home(key, replicas.ids)


def test_homes_spread_evenly_and_move_little_when_a_replica_goes():
    ids = [f"replica-{i}" for i in range(10)]
    keys = range(20000)
    homes = {k: rendezvous_home(k, ids) for k in keys}
    counts = Counter(homes.values())
    assert min(counts.values()) > 0.8 * 2000 and max(counts.values()) < 1.2 * 2000
    rest = ids[1:]
    moved = [k for k in keys if homes[k] != ids[0] and rendezvous_home(k, rest) != homes[k]]
    assert moved == []  # only the keys of the replica that went move


def test_kept_weights_are_the_weights_read_only_and_bounded(monkeypatch):
    monkeypatch.setattr(rendezvous, "KEPT_WEIGHTS_BYTES", 0)  # the floor: 16 keys
    replicas = ReplicaSet([f"replica-{i}" for i in range(50)])
    first = replicas.kept_weights(7)
    assert np.array_equal(first, replicas.weights(7))
    assert replicas.kept_weights(7) is first  # kept: the same array, not weighed again
    with pytest.raises(ValueError):
        first[0] = 0  # a caller cannot spoil the next decision's weights
    for key in range(100, 116):
        replicas.kept_weights(key)
    assert len(replicas._kept) == 16 and 7 not in replicas._kept  # the oldest went first
    assert np.array_equal(replicas.kept_weights(7), replicas.weights(7))
