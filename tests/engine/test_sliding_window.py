"""Sliding-window attention end to end: a Mistral whose window is far shorter than its prompts and
generations gives transformers' greedy tokens, with every backend, chunked or not, with prefix
hits and preemption; and a windowed-only model's KV stays bounded however long it generates."""
import json
import random

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests.tiny_models import build_tiny_model

WINDOW = 20  # not a multiple of the block size: the first kept block is partly outside
BLOCK_SIZE = 8
PROMPT_LENS = [70, 9, 45]  # 3.5 windows, under one, 2.25
MAX_TOKENS = [80, 30, 30]  # the first runs 7.5 windows long


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("mistral_window"), arch="mistral", num_heads=4,
                            num_kv_heads=2, seed=7)
    # The window changes no weight: set it in the config both models read.
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["sliding_window"] = WINDOW
    config_path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert hf_model.config.sliding_window == WINDOW
    rng = random.Random(0)
    vocab = hf_model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    prompts.append(prompts[0][:60] + [5, 6, 7])  # shares 7 blocks with the first: a prefix hit
    max_tokens = MAX_TOKENS + [25]
    expected = []
    for prompt, n in zip(prompts, max_tokens):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                    do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    # The window matters for these tokens: without it the model answers otherwise.
    ids = torch.tensor([prompts[0]])
    full = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, sliding_window=None).eval()
    with torch.no_grad():
        unwindowed = full.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=80,
                                   do_sample=False, pad_token_id=0)[0, len(prompts[0]):].tolist()
    assert unwindowed != expected[0]
    return prompts, max_tokens, expected


VARIANTS = {
    "torch": dict(attention_backend="torch"),
    "reference": dict(attention_backend="reference"),
    "torch_chunked_16": dict(attention_backend="torch", max_num_batched_tokens=16),
    # 10 usable blocks (80 tokens): less than the first request alone needs without the window.
    "torch_tiny_pool": dict(attention_backend="torch", num_kv_blocks=11, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(model_dir, reference, variant):
    prompts, max_tokens, expected = reference
    llm = LLM(model_dir, block_size=BLOCK_SIZE, dtype="float32", **VARIANTS[variant])
    engine = llm.llm_engine
    assert engine.runner.model.sliding_windows == [WINDOW, WINDOW]
    assert engine.max_model_len == 1024  # the rotary table's length, not the window's
    params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if variant == "torch":
        assert stats["prefix_cache_hits"] > 0


def test_kv_held_stays_bounded(model_dir, reference):
    prompts, _, _ = reference
    llm = LLM(model_dir, block_size=BLOCK_SIZE, attention_backend="torch", max_num_batched_tokens=32)
    engine = llm.llm_engine
    bm = engine.block_manager
    num_tokens = len(prompts[0]) + 200
    engine.add_request("long", {"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, bm.num_blocks - bm.num_free_blocks)
    # (window - 1 + one step's tokens + block_size - 1) / block_size blocks: 8 here, where the
    # whole sequence fills 34.
    bound = bm.max_blocks_held(num_tokens, 32)
    assert most <= bound == 8 and bm.blocks_needed(num_tokens) == 34
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
