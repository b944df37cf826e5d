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
# A reasoning model's template, as Qwen3's: `enable_thinking=False` closes an empty thinking block
# in the prompt, so the answer starts at once.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% endif %}",
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")
THINKING_TAGS = ["<think>", "</think>"]

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


def build_tokenizer(out_dir: str | Path, vocab_size: int = 384, thinking: bool = False):
    """thinking: a reasoning model's tokenizer, `<think>` and `</think>` one (non-special) token
    each, as Qwen3's and DeepSeek-R1's are, and a template that can close the thinking."""
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
    if thinking:
        from tokenizers import AddedToken
        fast.add_tokens([AddedToken(tag, special=False) for tag in THINKING_TAGS])
        fast.chat_template = THINKING_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | Path, arch: str = "llama", *, tie_word_embeddings: bool = False,
                     num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4,
                     num_kv_heads: int = 2, head_dim: int | None = None, seed: int = 0,
                     max_position_embeddings: int = 1024, dtype: str = "float32",
                     initializer_range: float = 0.2, rope_scaling: dict | None = None,
                     vocab_size: int = 384, thinking: bool = False) -> Path:
    """Save a seeded random checkpoint + tokenizer under out_dir; returns out_dir."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, vocab_size, thinking)
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


# Tiny configs of the other supported families, each exercising its quirks. Sizes are shared:
# hidden 64, 4 heads, a vocab of the tiny tokenizer's size; the rest is per family.
FAMILY_CONFIGS = {
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024, n_inner=128)),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, rotary_pct=0.25, use_parallel_residual=True,
                                       max_position_embeddings=1024)),
    "gpt_neox_sequential": ("GPTNeoXConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=128, rotary_pct=0.25,
                                                  use_parallel_residual=False, max_position_embeddings=1024)),
    "opt": ("OPTConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                              do_layer_norm_before=False, word_embed_proj_dim=32,
                              max_position_embeddings=1024)),
    "qwen3": ("Qwen3Config", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                  max_position_embeddings=1024)),
    "phi3": ("Phi3Config", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                                original_max_position_embeddings=64, partial_rotary_factor=0.5,
                                rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                              "long_factor": [2.0, 4.0, 8.0, 16.0]})),
    "mistral_window": ("MistralConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, sliding_window=8,
                                             max_position_embeddings=1024)),  # every layer windowed
    "mixtral": ("MixtralConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=1024)),
    "gemma2": ("Gemma2Config", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                    sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0, max_position_embeddings=1024)),
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                        sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24,
                                        rope_theta=1000.0, rope_local_base_freq=100.0,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                                        max_position_embeddings=1024)),
}


def build_tiny_family(out_dir: str | Path, family: str, *, seed: int = 0, initializer_range: float = 0.2,
                      **overrides) -> Path:
    """Save a seeded random checkpoint of one of FAMILY_CONFIGS (+ the tokenizer); returns out_dir.

    Biases and norm weights, which transformers initialises to constants, are randomised too, so
    a model that dropped or misplaced one would not match.
    """
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    config_name, fields = FAMILY_CONFIGS[family]
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **{**fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    gen = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir


def hf_greedy(hf_model, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, one prompt at a time (no padding)."""
    import torch

    expected = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    return expected
