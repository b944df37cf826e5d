"""Where a model's files come from: the embedded default model and embedding model, the cache
they are converted into."""
