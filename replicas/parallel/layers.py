"""The vocab-parallel token embedding: each rank holds rows [vocab_start, vocab_stop); a token
outside them looks up zeros, and one all-reduce sums the ranks' rows into every rank's hidden.
"""
from __future__ import annotations

import torch

from pagedserve.replicas.models.layers import Embedding
from pagedserve.replicas.parallel import state as parallel_state


class VocabParallelEmbedding(Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device,
                 tp: parallel_state.TensorParallel):
        self.vocab_start, self.vocab_stop = tp.vocab_range(num_embeddings)
        super().__init__(self.vocab_stop - self.vocab_start, embedding_dim, dtype, device)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        hidden = super().forward(local)  # dense or quantized rows
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)


def vocab_embedding(num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device) -> Embedding:
    """The plain Embedding at tensor_parallel_size 1, the vocab-parallel one otherwise."""
    tp = parallel_state.current()
    if tp.world_size == 1:
        return Embedding(num_embeddings, embedding_dim, dtype, device)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, dtype, device, tp)
