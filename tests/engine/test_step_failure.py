"""A step that raises fails only the requests it had scheduled: they are aborted with their blocks
freed, and the engine serves the rest with the tokens it would have produced anyway."""
from __future__ import annotations

import asyncio

import pytest

from replicas.async_engine import AsyncEngine
from replicas.config import EngineConfig
from replicas.engine import LLMEngine
from replicas.errors import StepFailed
from replicas.sampling_params import RequestOutputKind, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)


def _engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=64,
                                  block_size=16, max_model_len=256, **overrides))


def _fail_next_steps(engine: LLMEngine, count: int) -> None:
    execute = engine.runner.execute
    left = [count]

    def faulty(scheduler_output):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected")
        return execute(scheduler_output)
    engine.runner.execute = faulty


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    return done


def test_only_the_steps_requests_fail(tiny_model_dir):
    prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11, 12, 13]}
    expected = _engine(tiny_model_dir("llama"))
    for request_id, prompt in prompts.items():
        expected.add_request(request_id, prompt, PARAMS)
    expected = _run(expected)

    engine = _engine(tiny_model_dir("llama"), max_num_seqs=1)  # "b" waits while "a" steps
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, PARAMS)
    _fail_next_steps(engine, 1)
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["a"]
    assert "RuntimeError: injected" in str(failed.value)
    assert _run(engine) == {"b": expected["b"]}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_async_engine_serves_on_after_one_failure_and_stops_after_two(tiny_model_dir):
    async def main():
        engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir("llama")), num_threads=1,
                                          num_kv_blocks=64, block_size=16, max_model_len=256))

        async def generate(request_id):
            return [o async for o in engine.generate([5, 6, 7], PARAMS, request_id)]

        _fail_next_steps(engine.engine, 1)
        with pytest.raises(StepFailed):
            await generate("first")
        assert engine.is_healthy()
        (output,) = await generate("second")
        assert len(output.outputs[0].token_ids) == 6

        _fail_next_steps(engine.engine, 2)
        with pytest.raises(StepFailed):
            await generate("third")
        with pytest.raises(RuntimeError, match="engine loop died"):
            await generate("fourth")
        assert not engine.is_healthy()
        engine.shutdown()

    asyncio.run(main())
