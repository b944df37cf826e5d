"""Tiny random checkpoints, each built once per session on first use."""
from __future__ import annotations

import pytest

from tests.tiny_models import build_tiny_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

TINY_MODELS = {
    "llama": dict(arch="llama"),  # GQA 4:2, untied
    "mistral": dict(arch="mistral", seed=1),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True, seed=2),  # tied, q/k/v biases
    "llama_head_dim": dict(arch="llama", head_dim=32, seed=3),  # head_dim != hidden / heads
    "llama3_rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE, seed=4),
    "llama_bf16": dict(arch="llama", dtype="bfloat16", seed=5),
    "llama_thinking": dict(arch="llama", seed=7, thinking=True),  # <think> tags, one token each
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(name) -> the path of the checkpoint named in TINY_MODELS."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny_model(tmp_path_factory.mktemp(name), **TINY_MODELS[name])
        return built[name]

    return get
