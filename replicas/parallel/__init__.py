"""Tensor parallelism: one engine replica's model split over several ranks (processes).

state.py: a rank's group and collectives; sharding.py: which part of each checkpoint tensor a
rank holds; layers.py: the vocab-parallel embedding; worker.py: a rank other than the driver;
executor.py: how the driver starts and drives them (local processes or Ray actors).
"""
