"""bf16 end to end: a bf16 checkpoint run in bf16 by the engine against transformers in bf16,
with the KV cache in bf16 or fp32, and an fp32 model over a bf16 KV cache against fp32.

Both round every projection's fp32 sums to bf16, but in different orders (our panel GEMM,
oneDNN's), so logits differ by a bf16 ulp here and there, and on a random tiny model two top
tokens can sit that close. The comparison is therefore vLLM's own for low precision
(tests/models/utils.py check_logprobs_close): greedy tokens must be equal until the first
position where they differ; there each side's token must be among the other's top-k logprobs,
and the rest of that sequence is not compared. The test also requires most positions compared to
match exactly (39 of 40 did when written), and that the bf16 GEMM is what ran.
"""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagedserve.kernels import cpu_features, cpu_linear
from pagedserve import LLM, SamplingParams
from tests.tiny_models import build_tiny_model

TOP_K = 5
PROMPT_LENS = [1, 9, 33, 70]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("llama_bf16"), arch="llama", dtype="bfloat16",
                                hidden_size=96, num_heads=4, num_kv_heads=2, seed=7))


def hf_greedy_with_logprobs(model_dir: str, prompts: list[list[int]], dtype=torch.bfloat16):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        top = [set(torch.log_softmax(s[0].float(), -1).topk(TOP_K).indices.tolist()) for s in out.scores]
        results.append((tokens, top))
    return results


def check_logprobs_close(ours, theirs) -> tuple[int, int]:
    """vLLM's check_logprobs_close; returns (positions compared, positions equal)."""
    compared = equal = 0
    for (tokens, top), (hf_tokens, hf_top) in zip(ours, theirs):
        for i, (a, b) in enumerate(zip(tokens, hf_tokens)):
            compared += 1
            if a == b:
                equal += 1
                continue
            assert a in hf_top[i] and b in top[i], f"position {i}: {a} vs {b} beyond the top {TOP_K}"
            break
    return compared, equal


@pytest.fixture(scope="module")
def prompts(bf16_model_dir):
    rng = random.Random(0)
    vocab = transformers.AutoConfig.from_pretrained(bf16_model_dir).vocab_size
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_reference(bf16_model_dir, prompts):
    return hf_greedy_with_logprobs(bf16_model_dir, prompts)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_bf16_engine_matches_transformers_bf16(bf16_model_dir, prompts, hf_reference, kv_cache_dtype):
    llm = LLM(bf16_model_dir, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64)
    runner = llm.llm_engine.runner
    kv_dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.float32
    assert runner.dtype == torch.bfloat16 and all(c.dtype == kv_dtype for c in runner.kv_caches)
    if cpu_features.has_native_bf16():  # the bf16 GEMM is what runs, not a fallback
        packed = [m.packed for m in runner.model.modules() if isinstance(getattr(m, "packed", None),
                                                                        cpu_linear.PackedWeight)]
        assert packed and all(p.kind == "native_bf16" for p in packed)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [(o.outputs[0].token_ids, [set(pos) for pos in o.outputs[0].logprobs]) for o in outputs]
    compared, equal = check_logprobs_close(ours, hf_reference)
    assert equal >= 0.75 * compared, (equal, compared)
    stats = llm.llm_engine.stats()
    assert stats["dtype"] == "bfloat16" and stats["kv_cache_dtype"] == str(kv_dtype).removeprefix("torch.")
    cpu = stats["cpu"]
    assert cpu["level"] == cpu_features.cpu_level() and cpu["model"] and isinstance(cpu["flags"], list)
    assert cpu["bf16_gemm"].startswith("native_" if cpu_features.has_native_bf16() else ("onednn", "torch"))


def test_auto_dtype_runs_bf16_checkpoints_in_bf16_only_with_native_bf16(bf16_model_dir):
    llm = LLM(bf16_model_dir, num_kv_blocks=16)
    expected = "bfloat16" if cpu_features.has_native_bf16() else "float32"
    assert llm.llm_engine.stats()["dtype"] == expected


def test_float32_model_with_bf16_kv_cache_stays_close_to_transformers(bf16_model_dir, prompts):
    llm = LLM(bf16_model_dir, dtype="float32", kv_cache_dtype="bfloat16", num_kv_blocks=64)
    assert all(c.dtype == torch.bfloat16 for c in llm.llm_engine.runner.kv_caches)
    assert llm.llm_engine.stats()["kv_cache_dtype"] == "bfloat16"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [(o.outputs[0].token_ids, [set(pos) for pos in o.outputs[0].logprobs]) for o in outputs]
    compared, equal = check_logprobs_close(
        ours, hf_greedy_with_logprobs(bf16_model_dir, prompts, dtype=torch.float32))
    assert equal >= 0.75 * compared, (equal, compared)
