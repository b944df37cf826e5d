"""Speculative decoding through the real engine on a tiny float32 model: outputs are the tokens
plain decoding gives (greedy and seeded sampling), whatever the drafts, with every feature that
reads or ends a sequence token by token."""
import json

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.replicas.config import EngineConfig, SpeculativeConfig
from pagedserve.replicas.core.sampling_params import (
    RequestOutputKind, StructuredOutputsParams as Constraint,
)
from pagedserve.kernels import native
from tests import quant_checkpoints as qc
from tests.tiny_models import build_tiny_model

K = 4
PROMPTS = ["the quick brown fox jumps over the lazy dog the quick brown fox",
           "hello world hello world hello", "paged attention", "a b c d a b c d a b"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama",
                                max_position_embeddings=512))


def spec_config(**kw):
    return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": 64, **kw}


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(model_dir, max_model_len=512, dtype="float32")


@pytest.fixture(scope="module")
def spec(model_dir):
    return LLM(model_dir, max_model_len=512, dtype="float32", speculative_config=spec_config())


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def completions(outs):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


class Oracle:
    """Drafts that are plain decoding's own next tokens, with every `wrong_every`-th draft made
    wrong: long accepted runs, and rejections at every position."""

    def __init__(self, llm, expected: dict[tuple, list[int]], wrong_every: int = 3,
                 tail: tuple[int, ...] = ()):
        self.speculator = llm.llm_engine.speculator
        # prompt token ids -> plain decoding's outputs, then `tail` (drafts past their end)
        self.expected = {prompt: [*outputs, *tail] for prompt, outputs in expected.items()}
        self.wrong_every = wrong_every
        self.calls = 0

    def __enter__(self):
        self.saved = self.speculator.proposer.propose
        self.speculator.proposer.propose = self.propose
        return self

    def __exit__(self, *exc):
        self.speculator.proposer.propose = self.saved

    def propose(self, seq_id, token_ids, max_drafts, num_prompt_tokens=0):
        for prompt, outputs in self.expected.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = list(outputs[done:done + min(K, max_drafts)])
                self.calls += 1
                if drafts and self.wrong_every and self.calls % self.wrong_every == 0:
                    at = self.calls % len(drafts)
                    drafts[at] = (drafts[at] + 1) % 300
                return drafts
        return []


def oracle_for(llm, plain_outs, wrong_every=3, tail=()):
    return Oracle(llm, {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain_outs},
                  wrong_every, tail)


GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=11, max_tokens=40,
                        ignore_eos=True)
PENALIZED = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.3, min_p=0.05, seed=5, max_tokens=40, min_tokens=30)


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalties"])
def test_lookup_drafts_give_plain_tokens(plain, spec, params):
    before = spec.llm_engine.speculator.num_draft_tokens
    assert completions(run(spec, PROMPTS, params)) == completions(run(plain, PROMPTS, params))
    assert spec.llm_engine.speculator.num_draft_tokens > before  # drafts were proposed


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalties"])
def test_accepted_runs_give_plain_tokens(plain, spec, params):
    expected = run(plain, PROMPTS, params)
    speculator = spec.llm_engine.speculator
    accepted, steps = speculator.num_accepted_tokens, spec.llm_engine.num_steps
    with oracle_for(spec, expected):
        got = run(spec, PROMPTS, params)
    assert completions(got) == completions(expected)
    assert speculator.num_accepted_tokens - accepted > 60  # long runs were taken
    assert spec.llm_engine.num_steps - steps < 40  # fewer steps than tokens per request


def test_stops_inside_an_accepted_run(plain, spec):
    """A stop token, a stop string and max_tokens landing inside a verified run end the output
    exactly where plain decoding ends it: the tokens after are dropped."""
    free = run(plain, PROMPTS, GREEDY)
    outs = free[0].outputs[0]
    stop_id = outs.token_ids[9]
    stop_text = outs.text[len(outs.text) // 2:len(outs.text) // 2 + 3]
    for params in (GREEDY.clone(stop_token_ids=[stop_id]), GREEDY.clone(stop=[stop_text]),
                   GREEDY.clone(max_tokens=7), GREEDY.clone(stop=[stop_text], include_stop_str_in_output=True)):
        expected = run(plain, PROMPTS, params)
        with oracle_for(spec, free, wrong_every=0):
            got = run(spec, PROMPTS, params)
        assert completions(got) == completions(expected)


def test_logprobs_of_accepted_tokens(plain, spec):
    params = GREEDY.clone(logprobs=3, max_tokens=24)
    expected = run(plain, PROMPTS, params)
    with oracle_for(spec, expected):
        got = run(spec, PROMPTS, params)
    for e, g in zip(expected, got):
        e, g = e.outputs[0], g.outputs[0]
        assert g.token_ids == e.token_ids and len(g.logprobs) == len(e.logprobs)
        for pe, pg in zip(e.logprobs, g.logprobs):
            assert pe.keys() == pg.keys()
            assert all(abs(pe[t].logprob - pg[t].logprob) < 1e-4 and pe[t].rank == pg[t].rank
                       for t in pe)
        assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-3)


def test_n_samples_and_streamed_runs(plain, spec):
    params = SEEDED.clone(n=3)
    expected = run(plain, PROMPTS[:2], params)
    with oracle_for(spec, expected):
        assert completions(run(spec, PROMPTS[:2], params)) == completions(expected)
    # Streamed: an accepted run leaves as one delta, and the deltas join to the whole output.
    engine = spec.llm_engine
    whole = run(plain, PROMPTS[:1], GREEDY)[0].outputs[0]
    engine.add_request("stream", PROMPTS[0], GREEDY.clone(output_kind=RequestOutputKind.DELTA))
    deltas = []
    with oracle_for(spec, [run(plain, PROMPTS[:1], GREEDY)[0]], wrong_every=0):
        while engine.has_unfinished_requests():
            deltas += [o.outputs[0] for o in engine.step()]
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert max(len(d.token_ids) for d in deltas) == K + 1


def test_structured_output_rolls_the_grammar_back(model_dir, plain):
    """Drafts the grammar forbids are cut before they are run; rejected ones leave the grammar
    where the accepted tokens put it; every output still parses, equal to plain decoding's."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=Constraint(json=schema)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                             structured_outputs=Constraint(regex=r"(ab|cd){3,8}"))]
    spec = LLM(model_dir, max_model_len=512, dtype="float32", speculative_config=spec_config())
    for p in params:
        expected = run(plain, PROMPTS, p)
        with oracle_for(spec, expected):
            got = run(spec, PROMPTS, p)
        assert completions(got) == completions(expected)
    for o in got:
        assert len(o.outputs[0].text) >= 6
    # Drafts that run on past the grammar's end (an end of text, then more) are cut there.
    eos = spec.llm_engine.eos_token_ids[0]
    for p in params:
        expected = run(plain, PROMPTS, p)
        with oracle_for(spec, expected, wrong_every=0, tail=(eos, 5, 6)):
            assert completions(run(spec, PROMPTS, p)) == completions(expected)
    # Lookup drafts over free text are mostly invalid JSON: cut, never run.
    got = run(spec, PROMPTS, params[0])
    assert [json.loads(o.outputs[0].text) for o in got]


def test_chunked_prefill_and_preemption(model_dir, plain):
    """A small KV pool and token budget: drafts give way to blocks, preempted sequences are
    recomputed, and the outputs do not change."""
    tight = dict(max_model_len=512, dtype="float32", num_kv_blocks=16, max_num_batched_tokens=32)
    small = LLM(model_dir, **tight)
    spec = LLM(model_dir, **tight, speculative_config=spec_config())
    prompts = [p * 3 for p in PROMPTS]
    params = GREEDY.clone(max_tokens=64)
    expected = run(small, prompts, params)
    with oracle_for(spec, expected):
        got = run(spec, prompts, params)
    assert completions(got) == completions(expected)
    assert small.llm_engine.stats()["num_preemptions"] > 0
    assert spec.llm_engine.stats()["num_preemptions"] > 0
    assert spec.llm_engine.block_manager.num_free_blocks == spec.llm_engine.block_manager.num_blocks
    assert completions(run(plain, prompts, params)) == completions(expected)


@pytest.mark.skipif(not native.available(), reason="needs the native CPU kernels")
def test_verify_steps_take_the_native_decoder_stack(tmp_path, monkeypatch):
    """On a model the fused decoder stack takes (a Q4_1 GGUF), every step with drafts goes
    through it, one call through every layer, and the tokens are plain decoding's."""
    llama = build_tiny_model(tmp_path / "llama", "llama", seed=21, hidden_size=256, num_heads=4,
                             num_kv_heads=2)
    gguf = str(qc.write_gguf(llama, tmp_path / "q4_1.gguf", weight_type="Q4_1",
                             embedding_type="Q8_0")[0])
    plain = LLM(gguf, dtype="float32")
    spec = LLM(gguf, dtype="float32", speculative_config=spec_config())
    stack = spec.llm_engine.runner.model.model.decoder_stack
    assert stack is not None
    steps = []
    stack_run = stack.run

    def recording(hidden, cos, sin, caches, metadata, *rest):
        rows = hidden.shape[0]
        out = stack_run(hidden, cos, sin, caches, metadata, *rest)
        steps.append((rows > metadata.num_seqs and metadata.seq_lens_cpu[0] > rows, out is not None))
        return out

    monkeypatch.setattr(stack, "run", recording)
    expected = run(plain, PROMPTS, GREEDY)
    with oracle_for(spec, expected):
        assert completions(run(spec, PROMPTS, GREEDY)) == completions(expected)
    assert any(verify for verify, _ in steps) and all(taken for _, taken in steps)


def test_adapters_and_the_base_model_in_one_verify_step(model_dir, plain, tmp_path):
    """Rows of a LoRA adapter's drafts get its delta, as its decode rows do."""
    from pagedserve import LoRARequest
    from tests.lora_adapters import write_adapter
    lora = LoRARequest("a", 1, str(write_adapter(model_dir, tmp_path / "a", rank=8, seed=1)))
    engine = dict(max_model_len=512, dtype="float32", enable_lora=True, max_loras=2)
    base = LLM(model_dir, **engine)
    spec = LLM(model_dir, **engine, speculative_config=spec_config())
    loras = [lora, None, lora, None]
    expected = base.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    with oracle_for(spec, expected):
        got = spec.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert completions(got) == completions(expected)
    assert completions(expected)[0] != completions(run(plain, PROMPTS[:1], GREEDY))[0]


def test_suffix_drafts_an_answer_given_before(model_dir, plain):
    """Suffix decoding: a question asked again is drafted from the earlier answer, which no
    prompt holds; the tokens are plain decoding's either way."""
    spec = LLM(model_dir, max_model_len=512, dtype="float32", enable_prefix_caching=False,
               speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    speculator = spec.llm_engine.speculator
    # The cost model stays on its prior: on a loaded machine, step timings would otherwise
    # decide how much is drafted, and the counts below are about what suffix decoding finds.
    speculator.observe_step = lambda *timings: None
    expected = completions(run(plain, PROMPTS[:1], GREEDY))
    assert completions(run(spec, PROMPTS[:1], GREEDY)) == expected
    accepted, steps = speculator.num_accepted_tokens, spec.llm_engine.num_steps
    assert completions(run(spec, PROMPTS[:1], GREEDY)) == expected
    assert speculator.num_accepted_tokens - accepted >= 36  # of 47 after the first token
    assert spec.llm_engine.num_steps - steps <= 12
    # Sampled with a seed, and several requests at once, still plain decoding's tokens.
    assert completions(run(spec, PROMPTS, SEEDED)) == completions(run(plain, PROMPTS, SEEDED))


def test_batch_size_turns_drafts_off(model_dir):
    spec = LLM(model_dir, max_model_len=512, dtype="float32",
               speculative_config=spec_config(disable_by_batch_size=2))
    run(spec, PROMPTS, GREEDY)  # 4 running: no drafts until two have finished
    assert spec.llm_engine.speculator.num_drafts == 0
    run(spec, PROMPTS[:2], GREEDY)
    assert spec.llm_engine.speculator.num_drafts > 0
    stats = spec.llm_engine.stats()
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    assert len(stats["spec_decode_accepted_per_position"]) == K


def test_config_names_and_errors():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert (config.speculative_config.prompt_lookup_min,
            config.speculative_config.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3).prompt_lookup_min == 3
    suffix = SpeculativeConfig(method="suffix")
    assert (suffix.num_speculative_tokens, suffix.suffix_decoding_max_tree_depth,
            suffix.suffix_decoding_min_token_prob) == (24, 24, 0.1)
    for bad, needle in [({"method": "eagle3", "num_speculative_tokens": 2}, "'eagle3' is not supported"),
                        ({"model": "/draft", "num_speculative_tokens": 2}, "a draft model"),
                        ({"method": "ngram"}, "num_speculative_tokens"),
                        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4,
                          "prompt_lookup_max": 2}, "prompt_lookup_min"),
                        ("{not json", "not JSON")]:
        with pytest.raises(ValueError, match=needle):
            EngineConfig(speculative_config=bad)
