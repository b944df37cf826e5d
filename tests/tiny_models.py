"""Tiny random-weight HF checkpoints and an offline byte-level BPE tokenizer, for tests and benches.

Nothing is downloaded: configs are built in code, weights are seeded random, and the tokenizer is
trained in well under a second on a built-in corpus.
"""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the quick brown fox jumps over lazy dog paged attention blocks cache prefix serving tokens "
    "model replica router queue batch prefill decode kernel triton torch ray serve engine hello "
    "world paris france capital what is of a an and to in on for with from by at as it this that "
    "numbers 0 1 2 3 4 5 6 7 8 9 é ü 日本 語 emoji 🙂 code def return class import"
).split()


def _corpus(num_lines: int = 400) -> list[str]:
    import random
    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 20))) for _ in range(num_lines)]


def build_tokenizer(out_dir: str | Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token=None, additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | Path, arch: str = "llama", *, tie_word_embeddings: bool = False,
                     num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4,
                     num_kv_heads: int = 2, head_dim: int | None = None, seed: int = 0,
                     max_position_embeddings: int = 1024, dtype: str = "float32",
                     initializer_range: float = 0.2, rope_scaling: dict | None = None) -> Path:
    """Save a seeded random checkpoint + tokenizer under out_dir; returns out_dir."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config}[arch]
    kwargs = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    if arch == "mistral":
        kwargs["sliding_window"] = None
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM}[arch]
    model = model_cls(config).to(getattr(torch, dtype))
    if arch == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    gen = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir
