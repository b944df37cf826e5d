"""The engine against transformers itself: greedy tokens must match exactly, whatever the batching,
caching, chunking or preemption."""
import random

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.tiny_models import build_tiny_model

MODELS = {
    "llama": dict(arch="llama", num_heads=4, num_kv_heads=2),
    "mistral": dict(arch="mistral", num_heads=4, num_kv_heads=1, head_dim=32),
    "qwen2": dict(arch="qwen2", num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
}
PROMPT_LENS = [1, 7, 16, 17, 45, 64, 130, 300]
MAX_TOKENS = [12, 5, 20, 8, 16, 3, 10, 24]


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp(request.param), **MODELS[request.param]))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    # Two prompts sharing a 48-token prefix with the 130-token one, to exercise prefix hits.
    prompts += [prompts[6][:48] + [5, 6, 7], prompts[6][:100]]
    return prompts


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(model_dir, hf_model):
    prompts = make_prompts(hf_model.config.vocab_size)
    max_tokens = MAX_TOKENS + [9, 11]
    return prompts, max_tokens, [hf_greedy(hf_model, p, m) for p, m in zip(prompts, max_tokens)]


ENGINE_VARIANTS = {
    "default": {},
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_32": dict(max_num_batched_tokens=32),
    "tiny_kv_pool": dict(num_kv_blocks=28, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(model_dir, reference, variant):
    prompts, max_tokens, expected = reference
    llm = LLM(model_dir, attention_backend="torch", dtype="float32", **ENGINE_VARIANTS[variant])
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.prompt_token_ids for o in outputs] == prompts
    stats = llm.llm_engine.stats()
    if variant == "tiny_kv_pool":
        assert stats["num_preemptions"] > 0
    if variant == "default":
        assert stats["prefix_cache_hit_rate"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_arrived"] == len(prompts)  # what routers weigh their share by


def test_logprobs_match_transformers(model_dir, hf_model):
    prompt = make_prompts(hf_model.config.vocab_size)[4]
    llm = LLM(model_dir, dtype="float32")
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(ids).logits[0].float(), dim=-1)
    n = len(prompt)
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert position[token].logprob == pytest.approx(ref[n - 1 + i, token].item(), abs=1e-4)
        assert position[token].rank == 1  # greedy
        top = ref[n - 1 + i].topk(3).indices.tolist()
        assert set(top) <= set(position)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for p in range(1, n):
        assert out.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
