"""Sampling, stopping, n > 1, limits and cleanup through the real engine on a tiny model."""
import asyncio

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.replicas.config import EngineConfig
from pagedserve.serve_app.errors import OpenAIError
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=256))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=256)


def tokens(out):
    return [c.token_ids for c in out.outputs]


def test_seeded_sampling_is_batch_invariant(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate("the quick brown fox", params, use_tqdm=False)[0]
    others = [SamplingParams(temperature=0.8, max_tokens=n) for n in (3, 20, 7)]
    batch = llm.generate(["hello world", "the quick brown fox", "paged attention", "ray serve"],
                         [others[0], params, others[1], others[2]], use_tqdm=False)
    assert tokens(batch[1]) == tokens(alone)
    again = llm.generate("the quick brown fox", params.clone(seed=99), use_tqdm=False)[0]
    assert tokens(again) != tokens(alone)


def test_outputs_in_input_order(llm):
    prompts = [f"prompt {'x ' * i}" for i in range(6)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=2 + 3 * i) for i in range(6)],
                        use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [2 + 3 * i for i in range(6)]


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.llm_engine
    prompt = list(range(10, 74))  # 64 tokens = 4 full blocks of 16
    engine.block_manager.reset_prefix_cache()
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("n4", {"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, seed=0,
                                                                          max_tokens=8, ignore_eos=True))
    engine.step()
    # Sample 0 computes 4 blocks; samples 1-3 hit its first 3 and recompute only the last one.
    assert free_before - engine.block_manager.num_free_blocks == 4 + 3
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and len(final.outputs) == 4
    assert all(len(c.token_ids) == 8 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_strings_cut_exactly(llm):
    base = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text.index(stop)
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut + len(stop)]


def test_stop_token_ids_cut_exactly(llm):
    base = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[10]
    first = base.index(stop_id)
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                     stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id


def test_too_long_prompt_raises_clear_error(llm):
    with pytest.raises(ValueError, match="maximum context length is 256 tokens.*250 in the prompt"):
        llm.generate({"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_abort_frees_every_block(llm):
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"a{i}", "the quick brown fox " * (i + 1), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    for i in range(3):
        assert engine.abort_request(f"a{i}").outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_a_core_streams_and_aborts(model_dir):
    from tests.core_harness import generate, running_core, started

    async def main():
        async with running_core(EngineConfig(model=model_dir, max_model_len=256)) as (core, client):
            tokenizer = core.tokenizer()
            prompt = tokenizer.encode("hello world")
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            stream = await started(client, "s1", prompt, params)
            deltas = [out async for out in stream]
            assert len(deltas) >= 2 and deltas[-1].finished
            stream = await started(client, "s2", prompt, params.clone(max_tokens=200))
            stream.cancel()  # a client that goes away
            for _ in range(200):
                await asyncio.sleep(0.01)
                if not core.stats["num_requests"] and core.stats["kv_blocks_free"] \
                        == core.stats["kv_blocks_total"]:
                    break
            assert core.stats["kv_blocks_free"] == core.stats["kv_blocks_total"]
            with pytest.raises(OpenAIError, match="maximum context length"):
                await generate(client, "s3", [3] * 300, params)
            assert core.is_healthy()
            return sum((d.outputs[0].token_ids for d in deltas), [])

    tokens = asyncio.run(main())
    offline = LLM(model_dir, max_model_len=256).generate(
        "hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert tokens == offline[0].outputs[0].token_ids


def test_delta_and_final_only_outputs(model_dir):
    from pagedserve.replicas.core.sampling_params import RequestOutputKind
    from tests.core_harness import running_core, started

    async def main():
        async with running_core(EngineConfig(model=model_dir, max_model_len=256)) as (core, client):
            prompt = core.tokenizer().encode("hello world")
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, logprobs=1)
            deltas = [out async for out in await started(
                client, "d", prompt, params.clone(output_kind=RequestOutputKind.DELTA))]
            finals = [out async for out in await started(
                client, "f", prompt, params.clone(output_kind=RequestOutputKind.FINAL_ONLY))]
            return deltas, finals

    deltas, finals = asyncio.run(main())
    whole = LLM(model_dir, max_model_len=256).generate("hello world", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, n=2, logprobs=1), use_tqdm=False)[0]
    assert len(finals) == 1 and finals[0].finished
    assert [c.token_ids for c in finals[0].outputs] == [c.token_ids for c in whole.outputs]
    assert deltas[0].prompt_token_ids and not any(d.prompt_token_ids for d in deltas[1:])
    for index, want in enumerate(whole.outputs):
        mine = [c for d in deltas for c in d.outputs if c.index == index]
        assert "".join(c.text for c in mine) == want.text
        assert sum((c.token_ids for c in mine), []) == want.token_ids
        assert sum((c.logprobs for c in mine), []) == want.logprobs
        assert mine[-1].finish_reason == "length" and all(c.finish_reason is None for c in mine[:-1])


def test_a_request_keeps_the_block_hashes_it_came_with(llm):
    from pagedserve.replicas.core.block_hash import block_hashes

    engine = llm.llm_engine
    ids = list(range(3, 3 + 40))
    given = [11, 22]  # whatever the caller computed (the ingress, for routing): not recomputed
    request = engine.make_request("h1", {"prompt_token_ids": ids, "block_hashes": given},
                                  SamplingParams(n=2))
    assert [s.block_hashes for s in request.seqs] == [given, given]
    assert request.seqs[0].block_hashes is not request.seqs[1].block_hashes is not given
    plain = engine.make_request("h2", {"prompt_token_ids": ids}, SamplingParams())
    assert plain.seqs[0].block_hashes == block_hashes(ids, engine.block_size)


@pytest.mark.parametrize("prompt, params, param", [
    ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
    ({"prompt_token_ids": [10**9]}, SamplingParams(), "prompt"),
    ("hello", SamplingParams(logprobs=21), "logprobs"),
    ("hello", SamplingParams(prompt_logprobs=21), "prompt_logprobs"),
])
def test_engine_errors_name_their_field(llm, prompt, params, param):
    from pagedserve.replicas.core.sampling_params import ParamError

    with pytest.raises(ParamError) as info:
        llm.llm_engine.make_request("e", prompt, params)
    assert info.value.param == param
