"""A step that raises fails only the requests it had scheduled: they are aborted with their blocks
freed, and the engine serves the rest with the tokens it would have produced anyway."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.engine.llm_engine import LLMEngine
from pagedserve.replicas.core.errors import StepFailed
from pagedserve.replicas.core.sampling_params import RequestOutputKind, SamplingParams

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


class FailingEngine(LLMEngine):
    """Fails every step that runs a request whose id starts with "fail"."""

    def __init__(self, config):
        super().__init__(config)
        execute = self.runner.execute

        def faulty(scheduler_output):
            if any(s.seq.request_id.startswith("fail") for s in scheduler_output.scheduled):
                raise RuntimeError("injected")
            return execute(scheduler_output)
        self.runner.execute = faulty


def test_a_core_serves_on_after_one_failure_and_stops_after_two(tiny_model_dir):
    from pagedserve.serve_app.errors import OpenAIError
    from tests.core_harness import generate, running_core

    config = EngineConfig(model=str(tiny_model_dir("llama")), num_threads=1, num_kv_blocks=64,
                          block_size=16, max_model_len=256)

    async def main():
        async with running_core(config, engine_class=f"{__name__}:FailingEngine") as (core, client):
            with pytest.raises(OpenAIError, match="injected") as failed:
                await generate(client, "fail-first", [5, 6, 7], PARAMS)
            assert failed.value.status_code == 500 and failed.value.code == "engine_step_failed"
            assert core.is_healthy()
            output = await generate(client, "second", [5, 6, 7], PARAMS)
            assert len(output.outputs[0].token_ids) == 6
            with pytest.raises(OpenAIError, match="injected"):
                await generate(client, "fail-third", [5, 6, 7], PARAMS)
            with pytest.raises(OpenAIError):  # the second failure in a row: the core stops
                await generate(client, "fail-fourth", [5, 6, 7], PARAMS)
            for _ in range(100):
                if not core.is_healthy():
                    break
                await asyncio.sleep(0.05)
            assert not core.is_healthy() and "injected" in str(core.error)
            with pytest.raises(OpenAIError) as gone:  # nowhere left to send it
                await generate(client, "fifth", [5, 6, 7], PARAMS)
            assert gone.value.status_code == 503

    asyncio.run(main())
