"""Phi-3's longrope against transformers, on the tiny phi3 family (original context 64, 1024
positions).

transformers rotates every position of a forward with short_factor while the sequence fits the
original context and with long_factor once it is longer, recomputing the whole sequence when
`generate` crosses. We pick the set once from max_model_len, as vLLM does (rotary.py says why):
so a sequence matches `generate` exactly when its length is on the same side of the threshold as
max_model_len, and one that crosses matches a long-factor forward over its whole final sequence.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.replicas.models.rotary import RotaryEmbedding
from tests.tiny_models import FAMILY_CONFIGS, build_tiny_family, hf_greedy

ORIGINAL = FAMILY_CONFIGS["phi3"][1]["original_max_position_embeddings"]
LONG_PROMPT_LENS = [65, 70, 81, 96]  # all past the original context
LONG_MAX_TOKENS = [8, 3, 6, 8]
MODES = {  # blocks of 16; the longest sequence (104 tokens) needs 7
    "default": dict(num_kv_blocks=64),
    "chunked_32": dict(num_kv_blocks=64, max_num_batched_tokens=32),
    "preempted": dict(num_kv_blocks=8, max_num_batched_tokens=32),
}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = build_tiny_family(tmp_path_factory.mktemp("phi3_longrope"), "phi3")
    return str(path), transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(lens: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lens]


def _generate(llm: LLM, prompts, max_tokens, prompt_logprobs=None, ignore_eos=False):
    params = [SamplingParams(temperature=0, max_tokens=m, prompt_logprobs=prompt_logprobs, ignore_eos=ignore_eos)
              for m in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("max_model_len", [ORIGINAL, None])
def test_table_holds_the_factor_set_max_model_len_picks(max_model_len):
    config = transformers.Phi3Config(**FAMILY_CONFIGS["phi3"][1], vocab_size=32)
    hf = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    # transformers' set for a forward as long as the longest sequence we serve: all its positions
    length = max_model_len or config.max_position_embeddings
    cos, sin = hf(torch.zeros(1), torch.arange(length)[None])
    half = cos.shape[-1] // 2
    ours = RotaryEmbedding(config, 16, config.max_position_embeddings, torch.float32, max_model_len=max_model_len)
    got_cos, got_sin = ours(torch.arange(length))
    torch.testing.assert_close(got_cos[:, 0], cos[0, :, :half])
    torch.testing.assert_close(got_sin[:, 0], sin[0, :, :half])
    # the other set, in the same buffer
    other = config.max_position_embeddings if max_model_len else ORIGINAL
    buffer = ours.cos_sin.data_ptr()
    ours.set_max_model_len(other)
    cos, sin = hf(torch.zeros(1), torch.arange(other)[None])
    torch.testing.assert_close(ours(torch.arange(other))[0][:, 0], cos[0, :, :half])
    assert ours.cos_sin.data_ptr() == buffer


@pytest.mark.parametrize("mode", list(MODES))
def test_prompts_past_the_original_context_match_generate(phi3, mode):
    path, hf_model = phi3
    prompts = _prompts(LONG_PROMPT_LENS, hf_model.config.vocab_size, seed=1)
    expected = hf_greedy(hf_model, prompts, LONG_MAX_TOKENS)
    llm = LLM(path, attention_backend="torch", dtype="float32", **MODES[mode])
    prompt_logprobs = 1 if mode == "default" else None
    outputs = _generate(llm, prompts, LONG_MAX_TOKENS, prompt_logprobs)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if mode == "preempted":
        assert llm.llm_engine.stats()["num_preemptions"] > 0
    if prompt_logprobs is None:
        return
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for p in range(1, len(prompt)):
            assert output.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(ref[p - 1, prompt[p]].item(),
                                                                                 abs=1e-4)


def test_a_sequence_crossing_the_original_context_rotates_with_long_factors_throughout(phi3):
    """vLLM's behaviour, pinned: with max_model_len past the original context, a prompt shorter
    than it already uses long_factor, so every generated token, before and after the crossing, is
    the argmax of transformers' forward over the final sequence (long_factor everywhere, since that
    sequence is past the original context). `generate` itself would use short_factor until the
    crossing."""
    path, hf_model = phi3
    lens, max_tokens = [40, 56, 63, ORIGINAL], [30, 16, 8, 4]
    prompts = _prompts(lens, hf_model.config.vocab_size, seed=2)
    llm = LLM(path, attention_backend="torch", dtype="float32", num_kv_blocks=64,
              max_num_batched_tokens=32)
    for prompt, output in zip(prompts, _generate(llm, prompts, max_tokens, ignore_eos=True)):
        generated = output.outputs[0].token_ids
        sequence = prompt + generated
        assert len(sequence) > ORIGINAL
        with torch.no_grad():
            logits = hf_model(torch.tensor([sequence])).logits[0]
        assert logits[len(prompt) - 1:-1].argmax(dim=-1).tolist() == generated


def test_max_model_len_within_the_original_context_uses_short_factors(phi3):
    """The other side: short_factor, as `generate` uses it for every sequence that fits."""
    path, hf_model = phi3
    prompts = _prompts([5, 30, 50], hf_model.config.vocab_size, seed=3)
    llm = LLM(path, attention_backend="torch", dtype="float32", num_kv_blocks=64,
              max_model_len=ORIGINAL)
    for prompt, output in zip(prompts, _generate(llm, prompts, [ORIGINAL - len(p) for p in prompts])):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ORIGINAL - len(prompt),
                                    do_sample=False, pad_token_id=0)
        assert output.outputs[0].token_ids == out[0, len(prompt):].tolist()
