"""tensor_parallel_size=2 on CPU (gloo, two local processes): greedy tokens equal
tensor_parallel_size=1 and transformers, logprobs within 1e-4, for GQA (2 KV heads over 2 ranks),
a replicated KV head (1 KV head over 2 ranks), Qwen2 (tied embeddings, q/k/v biases), Mistral,
Qwen3 and Phi-3 (checkpoint-fused projections), and a vocabulary of odd size,
in the default mode and with chunked prefill under forced preemption; each rank holds about half
of the weights; bad sizes fail at once naming both numbers; a rank that dies fails the health
check and the next step instead of hanging them; an LLM dropped without shutdown() frees its
group for the next one; drafts are verified over both ranks."""
from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pagedserve import LLM, SamplingParams
from pagedserve.replicas.models.loader import iterate_weights, load_config, weight_files
from pagedserve.replicas.models import get_model_class
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.parallel.sharding import check_tensor_parallel, check_world_size
from tests.engine.tp_checks import (ENGINE, MAX_TOKENS, MODES, assert_same_outputs, generate,
                                    transformers_reference)
from tests.tiny_models import build_tiny_family, build_tiny_model

MODELS = {
    "llama_kv2": dict(arch="llama", num_kv_heads=2),
    "llama_kv1": dict(arch="llama", num_kv_heads=1, seed=1),  # one KV head, replicated
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True, seed=2),
    "mistral": dict(arch="mistral", seed=3),
    "qwen3": dict(family="qwen3"),  # per-head q/k norms
    "phi3": dict(family="phi3"),  # q|k|v and gate|up fused in the checkpoint, partial rotary
    # A vocabulary that does not split in two: the last rank's rows are one fewer, padded for the
    # logits gather and cut after it.
    "llama_odd_vocab": dict(arch="llama", vocab_size=383, seed=4),
}
ENGINE_ARGS = {"phi3": dict(max_model_len=64)}  # longrope's short factors, as transformers here
SLOW = pytest.mark.slow  # each case starts a rank process (~5 s): the default suite keeps four
CASES = [pytest.param("llama_kv2", "default"), pytest.param("llama_kv2", "chunked_preempted"),
         pytest.param("llama_kv1", "default"),
         pytest.param("llama_kv1", "chunked_preempted", marks=SLOW),
         pytest.param("qwen2", "default"),
         pytest.param("qwen2", "chunked_preempted", marks=SLOW),
         pytest.param("mistral", "default", marks=SLOW),
         pytest.param("mistral", "chunked_preempted", marks=SLOW),
         pytest.param("qwen3", "default", marks=SLOW), pytest.param("phi3", "default", marks=SLOW),
         pytest.param("llama_odd_vocab", "default", marks=SLOW)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            spec = MODELS[name]
            path = (build_tiny_family(tmp_path_factory.mktemp(name), spec["family"])
                    if "family" in spec else build_tiny_model(tmp_path_factory.mktemp(name), **spec))
            built[name] = transformers_reference(path)
        return built[name]

    return get


@pytest.mark.parametrize("name,mode", CASES)
def test_tp2_matches_tp1_and_transformers(models, name, mode):
    model = models(name)
    with_prompt_logprobs = mode == "default"
    engine = {**ENGINE, **MODES[mode], **ENGINE_ARGS.get(name, {})}
    single = generate(LLM(model.path, **engine), model.prompts, prompt_logprobs=with_prompt_logprobs)
    llm = LLM(model.path, tensor_parallel_size=2, **engine)
    try:
        split = generate(llm, model.prompts, prompt_logprobs=with_prompt_logprobs)
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in single] == model.expected
    assert_same_outputs(single, split, with_prompt_logprobs)
    if mode == "chunked_preempted":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_tp2_verifies_drafts_with_the_tokens_of_tp1(models):
    """Speculative decoding over two ranks: verify rows are rows like any other to rank 1."""
    model = models("llama_kv2")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "disable_by_batch_size": 64}
    llm = LLM(model.path, tensor_parallel_size=2, speculative_config=spec,
              **{**ENGINE, **MODES["default"]})
    try:
        split = generate(llm, model.prompts)
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in split] == model.expected
    assert stats["spec_decode_num_draft_tokens"] > 0


def _shard_bytes(path: str, rank: int, world_size: int) -> int:
    """Parameter bytes one rank loads (the group itself is not needed to load)."""
    hf_config = load_config(path)
    tp = parallel_state.TensorParallel(rank, world_size)
    with parallel_state.building(tp):
        model = get_model_class(hf_config)(hf_config, torch.float32, "torch")
    model.load_weights(iterate_weights(weight_files(path), lazy=world_size > 1))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_each_rank_holds_about_half_the_weights(models):
    path = models("llama_kv2").path
    full = _shard_bytes(path, 0, 1)
    for rank in (0, 1):  # only norms are replicated
        assert 0.45 < _shard_bytes(path, rank, 2) / full < 0.55


def test_sizes_that_do_not_split_fail_at_once_naming_both_numbers(models):
    path = models("llama_kv2").path  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide the model's "
                                         r"num_attention_heads \(4\)"):
        LLM(path, tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) is more than the CPUs "
                                         r"available \(2\)"):
        check_world_size(4, "cpu", available=2)
    gqa = SimpleNamespace(num_attention_heads=12, num_key_value_heads=3, intermediate_size=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) and the model's "
                                         r"num_key_value_heads \(3\)"):
        check_tensor_parallel(gqa, 2, get_model_class(load_config(path)))


def test_a_dead_rank_fails_the_health_check_and_the_next_step(models):
    model = models("llama_kv2")
    llm = LLM(model.path, tensor_parallel_size=2, **ENGINE, num_kv_blocks=16)
    try:
        engine = llm.llm_engine
        engine.check_health()
        engine.runner.workers.ranks.processes[0].kill()
        deadline = time.monotonic() + 10
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 is gone"):
            while time.monotonic() < deadline:
                engine.check_health()
                time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(Exception):
            llm.generate([model.prompts[0]], SamplingParams(temperature=0, max_tokens=2),
                         use_tqdm=False)
        assert time.monotonic() - start < 30  # a failed step, not a collective timeout
    finally:
        llm.shutdown()


def test_a_dropped_llm_releases_its_group_for_the_next(models):
    """`del llm` without shutdown(): collecting it must free the process's group (and end its
    ranks), or the next tensor-parallel LLM in this process cannot join one; shutdown() then
    collection releases nothing twice."""
    model = models("llama_kv2")
    prompts, max_tokens = model.prompts[:2], MAX_TOKENS[:2]
    llm = LLM(model.path, tensor_parallel_size=2, **ENGINE, num_kv_blocks=16)
    first = generate(llm, prompts, max_tokens, prompt_logprobs=False)
    ranks = list(llm.llm_engine.runner.workers.ranks.processes)
    del llm
    gc.collect()
    assert all(process.poll() is not None for process in ranks)
    llm = LLM(model.path, tensor_parallel_size=2, **ENGINE, num_kv_blocks=16)
    try:
        second = generate(llm, prompts, max_tokens, prompt_logprobs=False)
    finally:
        llm.shutdown()
    llm.shutdown()
    del llm
    gc.collect()
    assert not dist.is_initialized()
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    assert [o.outputs[0].token_ids for o in first] == model.expected[:2]
