"""Model implementations, looked up by the `architectures` entry of a checkpoint's config.json.

The catalogue: one file per family whose layer shape differs, the shared pieces beside them
(layers, rotary, attention, mlp, causal_lm).
"""
from __future__ import annotations

from pagedserve.replicas.models.bert import BertModel
from pagedserve.replicas.models.gemma import GemmaForCausalLM
from pagedserve.replicas.models.gpt2 import GPT2LMHeadModel
from pagedserve.replicas.models.gpt_neox import GPTNeoXForCausalLM
from pagedserve.replicas.models.llama import LlamaForCausalLM
from pagedserve.replicas.models.mixtral import MixtralForCausalLM
from pagedserve.replicas.models.opt import OPTForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + per-head q/k RMSNorm
    "Phi3ForCausalLM": LlamaForCausalLM,  # fused checkpoint projections, longrope
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    # Encoders (embedding models): replicas/model_files/embedding_model.py lists the architectures it serves.
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,
    "BertForPreTraining": BertModel,
}
# For configs written without `architectures`.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gpt2": "GPT2LMHeadModel",
                "gpt_neox": "GPTNeoXForCausalLM", "opt": "OPTForCausalLM",
                "bert": "BertModel"}


def get_model_class(hf_config) -> type:
    """The class for the checkpoint's first supported architecture; ValueError naming it otherwise."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures and getattr(hf_config, "model_type", None) in _MODEL_TYPES:
        architectures = [_MODEL_TYPES[hf_config.model_type]]
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    found = architectures or getattr(hf_config, "model_type", None)
    raise ValueError(f"unsupported model architecture {found}: supported are {list(MODEL_REGISTRY)}")


__all__ = ["BertModel", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "GemmaForCausalLM", "LlamaForCausalLM", "MODEL_REGISTRY",
           "MixtralForCausalLM", "OPTForCausalLM", "get_model_class"]
