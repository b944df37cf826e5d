"""Model implementations, looked up by the `architectures` entry of a checkpoint's config.json."""
from __future__ import annotations

from replicas.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
# For configs written without `architectures`.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def get_model_class(hf_config) -> type:
    """The class for the checkpoint's first supported architecture; ValueError if there is none."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures and getattr(hf_config, "model_type", None) in _MODEL_TYPES:
        architectures = [_MODEL_TYPES[hf_config.model_type]]
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    found = architectures or getattr(hf_config, "model_type", None)
    raise ValueError(f"unsupported model architecture {found}: supported are {sorted(MODEL_REGISTRY)}")


__all__ = ["LlamaForCausalLM", "MODEL_REGISTRY", "get_model_class"]
