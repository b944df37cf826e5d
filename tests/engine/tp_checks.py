"""What the tensor-parallel tests share: the seeded prompts, transformers' greedy tokens for them,
generating with sampled (and prompt) logprobs, and the check that tensor_parallel_size=2 gave what
tensor_parallel_size=1 gave."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.tiny_models import hf_greedy

PROMPT_LENS = [1, 3, 9, 17, 33, 40]
MAX_TOKENS = [10, 5, 8, 12, 6, 12]
MODES = {
    "default": dict(num_kv_blocks=64),
    # 5 blocks of 16: the longest sequence (52 tokens) fits, the batch wants more; 32-token chunks
    "chunked_preempted": dict(num_kv_blocks=5, max_num_batched_tokens=32),
}
# float32: what transformers is compared in (auto is bf16 on CPUs with AVX512-BF16)
ENGINE = dict(attention_backend="torch", num_threads=2, dtype="float32")


def random_prompts(vocab_size: int, lengths: list[int] = PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def transformers_reference(path) -> SimpleNamespace:
    """The checkpoint's path, seeded prompts and transformers' greedy tokens for them."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size)
    return SimpleNamespace(path=str(path), prompts=prompts, expected=hf_greedy(hf, prompts, MAX_TOKENS))


def generate(llm: LLM, prompts, max_tokens: list[int] = MAX_TOKENS, prompt_logprobs: bool = True):
    params = [SamplingParams(temperature=0, max_tokens=m, logprobs=1,
                             prompt_logprobs=1 if prompt_logprobs else None) for m in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_same_outputs(single, split, prompt_logprobs: bool = True) -> None:
    """Greedy tokens equal; sampled (and prompt) logprobs within 1e-4."""
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single]
    for a, b in zip(single, split):
        for pa, pb, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert pb[token].logprob == pytest.approx(pa[token].logprob, abs=1e-4)
        if prompt_logprobs:
            for p, (pa, pb) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]), start=1):
                token = a.prompt_token_ids[p]
                assert pb[token].logprob == pytest.approx(pa[token].logprob, abs=1e-4)
