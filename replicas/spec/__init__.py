"""Speculative decoding's proposing side: which sequences get drafts and how many (speculator.py),
and the drafts themselves, by prompt lookup (ngram.py) or suffix decoding over the prompt and
recent requests' outputs (suffix.py). Verifying them is the sampler's
(replicas/execution/verify.py)."""
