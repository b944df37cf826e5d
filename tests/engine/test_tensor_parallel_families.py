"""tensor_parallel_size=2 for the families with their own layer code (GPT-2, GPT-NeoX, OPT, Gemma 2
and 3, Mixtral), on CPU (gloo, two local processes): greedy tokens equal tensor_parallel_size=1
and transformers, logprobs within 1e-4, in the default mode and with chunked prefill under forced
preemption; each rank reads only its part of every sharded checkpoint tensor, and holds whole only
what vLLM replicates too (norms, learned positions, OPT's projections in and out, the router, the
row-parallel biases, added once)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from pagedserve.kernels import native_linear
from pagedserve import LLM
from pagedserve.replicas.models.loader import iterate_weights, load_config, weight_files
from pagedserve.replicas.models import BertModel, get_model_class
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.parallel.sharding import check_tensor_parallel
from tests.engine.tp_checks import (ENGINE, MODES, assert_same_outputs, generate,
                                    transformers_reference)
from tests.tiny_models import build_tiny_family

FAMILIES = ["gpt2", "gpt_neox", "gpt_neox_sequential", "opt", "gemma2", "gemma3", "mixtral"]
SLOW = pytest.mark.slow  # each case starts a rank process (~5 s): the default suite keeps two
CASES = [pytest.param("gpt2", "default"), pytest.param("mixtral", "default"),
         pytest.param("gpt_neox", "default", marks=SLOW),
         pytest.param("gpt_neox_sequential", "default", marks=SLOW),
         pytest.param("opt", "default", marks=SLOW),
         pytest.param("gemma2", "default", marks=SLOW), pytest.param("gemma3", "default", marks=SLOW),
         pytest.param("opt", "chunked_preempted", marks=SLOW),
         pytest.param("mixtral", "chunked_preempted", marks=SLOW)]
# Parameters every rank holds whole: norms, learned position tables, OPT's project_in/out, the
# MoE router, and row-parallel biases (real on rank 0, zeros elsewhere).
REPLICATED = re.compile(r"norm|\.ln_|wpe|embed_positions|project_(in|out)|\.mlp\.gate\."
                        r"|(o_proj|down_proj|fc2)\.bias")
ROW_PARALLEL_BIAS = re.compile(r"(o_proj|down_proj|fc2)\.bias")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """families(name) -> its checkpoint path; families(name, expected=True) adds prompts and
    transformers' greedy tokens."""
    paths, built = {}, {}

    def get(name: str, expected: bool = False):
        if name not in paths:
            paths[name] = str(build_tiny_family(tmp_path_factory.mktemp(name), name))
        if not expected:
            return paths[name]
        if name not in built:
            built[name] = transformers_reference(paths[name])
        return built[name]

    return get


@pytest.mark.parametrize("name,mode", CASES)
def test_tp2_matches_tp1_and_transformers(families, name, mode):
    model = families(name, expected=True)
    with_prompt_logprobs = mode == "default"
    engine = {**ENGINE, **MODES[mode]}
    single = generate(LLM(model.path, **engine), model.prompts, prompt_logprobs=with_prompt_logprobs)
    llm = LLM(model.path, tensor_parallel_size=2, **engine)
    try:
        split = generate(llm, model.prompts, prompt_logprobs=with_prompt_logprobs)
        stats = llm.llm_engine.stats()
        moe = [m for m in llm.llm_engine.runner.model.modules() if hasattr(m, "grouped")]
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in single] == model.expected
    assert_same_outputs(single, split, with_prompt_logprobs)
    if mode == "chunked_preempted":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if name == "mixtral" and native_linear.linear_available():  # rank 0's expert shards, grouped
        assert moe and all(m.grouped is not None for m in moe)


class _CountingSlice:
    """A safetensors slice that counts the elements read through it."""

    def __init__(self, source, counter: list[int]):
        self.source, self.counter = source, counter

    def get_shape(self):
        return self.source.get_shape()

    def __getitem__(self, index):
        part = self.source[index]
        self.counter[0] += part.numel()
        return part


def _load_rank(path: str, rank: int, world_size: int):
    """(model, elements read from the checkpoint) for one rank (the group is not needed to load)."""
    hf_config = load_config(path)
    with parallel_state.building(parallel_state.TensorParallel(rank, world_size)):
        model = get_model_class(hf_config)(hf_config, torch.float32, "torch")
    counter, lazy = [0], world_size > 1  # only a rank of a group reads slices
    weights = iterate_weights(weight_files(path), lazy=lazy)
    if lazy:
        weights = ((name, _CountingSlice(source, counter)) for name, source in weights)
    model.load_weights(weights)
    return model, counter[0]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_rank_reads_and_holds_only_its_shard(families, name):
    path = families(name)
    full = {n: p.shape for n, p in _load_rank(path, 0, 1)[0].named_parameters()}
    for rank in (0, 1):
        model, read = _load_rank(path, rank, 2)
        held = dict(model.named_parameters())
        assert held.keys() == full.keys()
        for param_name, param in held.items():
            if REPLICATED.search(param_name):
                assert param.shape == full[param_name], param_name
            else:  # split along exactly one dimension
                halved = [a * 2 == b for a, b in zip(param.shape, full[param_name])]
                assert len(param.shape) == len(full[param_name]) and halved.count(True) == 1, param_name
                assert sum(a == b for a, b in zip(param.shape, full[param_name])) == param.dim() - 1
        # Rank 0 reads exactly what it holds; the others skip the row-parallel biases (zeros).
        zeros = 0 if rank == 0 else sum(p.numel() for n, p in held.items() if ROW_PARALLEL_BIAS.search(n))
        assert read == sum(p.numel() for p in held.values()) - zeros


def test_a_family_that_does_not_shard_says_so():
    config = SimpleNamespace(architectures=["BertModel"], num_attention_heads=4)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported for "
                                         "BertModel yet"):
        check_tensor_parallel(config, 2, BertModel)
