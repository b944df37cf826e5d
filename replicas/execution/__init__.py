"""Model execution: the persistent input batch, the model runner (prepare -> forward -> logits ->
sample), the sampler with its penalties and logprobs, and pooling for embeddings."""
