"""Priority scheduling end to end: urgent requests finish first under pressure, every request's
greedy tokens stay what they are without priorities, and fcfs refuses a priority."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.replicas.core.sampling_params import ParamError

ARGS = dict(num_threads=1, num_kv_blocks=64, block_size=16, max_model_len=256)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_priority_changes_order_not_tokens(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    fcfs = LLM(model, **ARGS).generate(prompts, PARAMS, use_tqdm=False)
    llm = LLM(model, max_num_seqs=1, scheduling_policy="priority", **ARGS)
    engine = llm.llm_engine
    order = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS, priority=[3, 1, 2, 0, 1, 5][i])
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["r3", "r1", "r4", "r2", "r0", "r5"]
    by_priority = llm.generate(prompts, PARAMS, use_tqdm=False, priority=[3, 1, 2, 0, 1, 5])
    assert [o.outputs[0].token_ids for o in by_priority] == [o.outputs[0].token_ids for o in fcfs]


def test_fcfs_refuses_a_priority(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), **ARGS)
    with pytest.raises(ParamError, match="priority scheduling is not enabled") as error:
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False, priority=[1])
    assert error.value.param == "priority"
