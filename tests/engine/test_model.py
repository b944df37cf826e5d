"""Our Llama-family decoder against transformers, through the paged KV cache (reference backend)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.replicas.models.loader import load_model
from pagedserve.replicas.models import LlamaForCausalLM
from pagedserve.replicas.models.rotary import inverse_frequencies, rope_parameters

BLOCK_SIZE = 4
NUM_BLOCKS = 32
PROMPT_LENS = [5, 11, 7]
# Scattered, non-contiguous blocks with room for a few decode steps.
BLOCK_TABLES = [[9, 2, 17], [0, 13, 5, 21, 6], [30, 4, 11]]
ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "llama_head_dim", "llama3_rope"])
def models(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    model, hf_config, _ = load_model(path, dtype="float32", attention_backend="reference")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, hf_model


def make_prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lens]


def new_kv_caches(model, dtype=torch.float32) -> list[torch.Tensor]:
    shape = model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
    return [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] logits of a full forward without any cache."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def run_step(model, kv_caches, seqs: list[tuple[list[int], int, int]]) -> list[torch.Tensor]:
    """One packed step. seqs: (context token ids, num cached, block-table index); every sequence
    computes its tokens [num_cached:]. Returns each sequence's logits rows."""
    input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
    for tokens, num_cached, table in seqs:
        input_ids += tokens[num_cached:]
        positions += range(num_cached, len(tokens))
        query_lens.append(len(tokens) - num_cached)
        seq_lens.append(len(tokens))
        tables.append(BLOCK_TABLES[table])
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    hidden = model(torch.tensor(input_ids), torch.tensor(positions), kv_caches, metadata)
    logits = model.compute_logits(hidden)
    assert logits.dtype == model.lm_head.weight.dtype  # the model's dtype: consumers widen
    assert logits.shape == (len(input_ids), model.vocab_size)
    return list(logits.split(query_lens))


def test_packed_prefill_matches_transformers(models):
    model, hf_model = models
    prompts = make_prompts(model.vocab_size)
    kv_caches = new_kv_caches(model)
    outputs = run_step(model, kv_caches, [(p, 0, i) for i, p in enumerate(prompts)])
    for prompt, logits in zip(prompts, outputs):
        torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=ATOL, rtol=0)


def test_decode_reads_paged_cache(models):
    model, hf_model = models
    seqs = make_prompts(model.vocab_size, seed=1)
    kv_caches = new_kv_caches(model)
    outputs = run_step(model, kv_caches, [(p, 0, i) for i, p in enumerate(seqs)])
    for _ in range(3):
        for seq, logits in zip(seqs, outputs):
            seq.append(int(logits[-1].argmax()))
        outputs = run_step(model, kv_caches, [(s, len(s) - 1, i) for i, s in enumerate(seqs)])
        for seq, logits in zip(seqs, outputs):
            torch.testing.assert_close(logits[0], hf_logits(hf_model, seq)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_transformers(models):
    model, hf_model = models
    long_prompt, short_prompt = make_prompts(model.vocab_size, lens=[13, 4], seed=2)
    expected = hf_logits(hf_model, long_prompt)
    kv_caches = new_kv_caches(model)
    first, short = run_step(model, kv_caches, [(long_prompt[:6], 0, 1), (short_prompt, 0, 0)])
    torch.testing.assert_close(first, expected[:6], atol=ATOL, rtol=0)
    # The second chunk shares its step with a decode of the other sequence.
    short_prompt.append(int(short[-1].argmax()))
    second, decoded = run_step(model, kv_caches, [(long_prompt, 6, 1), (short_prompt, 4, 0)])
    torch.testing.assert_close(second, expected[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(decoded[0], hf_logits(hf_model, short_prompt)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_agrees_with_float32(tiny_model_dir, dtype):
    path = tiny_model_dir("llama")
    model32, _, _ = load_model(path, dtype="float32", attention_backend="reference")
    model16, _, torch_dtype = load_model(path, dtype=dtype, attention_backend="reference")
    assert torch_dtype == dtype and model16.model.embed_tokens.weight.dtype == dtype
    prompts = make_prompts(model32.vocab_size, seed=3)
    batch = [(p, 0, i) for i, p in enumerate(prompts)]
    logits32 = torch.cat(run_step(model32, new_kv_caches(model32), batch))
    logits16 = torch.cat(run_step(model16, new_kv_caches(model16, dtype), batch))
    assert torch.isfinite(logits16).all()
    agree = (logits16.argmax(-1) == logits32.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree


def test_llama3_rope_scaling_changes_frequencies(tiny_model_dir):
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir("llama3_rope"))
    scaled = inverse_frequencies(config, 16)
    plain = inverse_frequencies(SimpleNamespace(rope_theta=10000.0), 16)
    assert plain[0] / 8 < scaled[0] < plain[0]  # a medium frequency: smoothed
    torch.testing.assert_close(scaled[1:], plain[1:] / 8)  # low frequencies: divided by factor


def test_rope_parameters_reads_transformers_4_fields():
    config = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(config) == {"type": "linear", "factor": 2.0, "rope_theta": 500000.0,
                                       "rope_type": "linear"}
    torch.testing.assert_close(inverse_frequencies(config, 8),
                               inverse_frequencies(SimpleNamespace(rope_theta=500000.0), 8) / 2)
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        inverse_frequencies(SimpleNamespace(rope_scaling={"rope_type": "yarn"}), 8)


def test_load_weights_rejects_bad_checkpoints(tiny_model_dir):
    from safetensors.torch import load_file

    path = tiny_model_dir("llama")
    _, hf_config, _ = load_model(path, attention_backend="reference")
    model = LlamaForCausalLM(hf_config, attention_backend="reference")  # not loaded, not packed
    weights = load_file(str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights: model.layers.1.self_attn.k_proj.weight"):
        model.load_weights((n, t) for n, t in weights.items()
                           if n != "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        model.load_weights([*weights.items(), ("model.extra.weight", torch.zeros(1))])
    bad = dict(weights, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        model.load_weights(bad.items())


@pytest.mark.parametrize("config_class, fields, expected", [
    (transformers.MistralConfig, dict(sliding_window=64), [64, 64]),
    (transformers.MistralConfig, dict(sliding_window=None), [None, None]),
    (transformers.Qwen2Config, dict(sliding_window=64), [None, None]),  # use_sliding_window is False
    (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), [None, 64]),
])
def test_sliding_windows_per_layer(config_class, fields, expected):
    config = config_class(vocab_size=32, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, num_hidden_layers=2,
                          max_position_embeddings=256, **fields)
    model = LlamaForCausalLM(config, attention_backend="reference")
    assert model.sliding_windows == expected
    assert model.max_context_len == 256  # the backend applies the windows: no cap at them


def test_cpu_projections_run_on_packed_weights(tiny_model_dir):
    from pagedserve.replicas.models.llama import Linear

    for name in ("llama", "qwen2"):  # untied lm_head; tied lm_head and q/k/v biases
        model, _, _ = load_model(tiny_model_dir(name), dtype="float32")
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed is not None for m in linears)
        assert (model.tied_lm_head_packed is not None) == model.tie_word_embeddings
