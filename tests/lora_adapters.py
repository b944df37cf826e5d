"""Random PEFT LoRA adapters for tiny models, written by peft itself, and peft's greedy tokens
with them: the reference the engine's adapters are compared with."""
from __future__ import annotations

from pathlib import Path

# The projections an adapter changes in each family, by transformers' module names.
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILY_TARGETS = {
    "llama": LLAMA_TARGETS, "qwen3": LLAMA_TARGETS, "mistral_window": LLAMA_TARGETS,
    "gemma2": LLAMA_TARGETS, "gemma3": LLAMA_TARGETS,
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "gpt_neox_sequential": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],  # experts see regrouped rows
}


def write_adapter(base: str | Path, out_dir: str | Path, *, rank: int, alpha: float | None = None,
                  targets: list[str] | None = None, seed: int = 0, use_rslora: bool = False,
                  family: str = "llama", scale: float = 1.0) -> Path:
    """A LoRA adapter of `base` with random A and B (B non-zero, so it changes the outputs),
    saved by peft's save_pretrained; B is multiplied by `scale`."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0,
                        target_modules=targets or FAMILY_TARGETS[family], init_lora_weights=False,
                        use_rslora=use_rslora, fan_in_fan_out=family == "gpt2")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    out_dir = Path(out_dir)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_model(base: str | Path, adapter: str | Path | None, state: dict | None = None):
    """transformers' model of `base` (its weights replaced by `state` if given), with the
    adapter applied by peft (None: the base alone)."""
    import torch
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model if adapter is None else PeftModel.from_pretrained(model, str(adapter)).eval()
