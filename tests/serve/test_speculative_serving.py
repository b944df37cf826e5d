"""Speculative decoding served for real: `speculative_config` given as `serve run` passes it
(JSON text), a streamed completion through the `openai` SDK gives the offline engine's greedy
text with verified runs leaving as single deltas, and the replica counts its drafts."""
from __future__ import annotations

import json

import pytest

from tests.serve.conftest import API_KEY, ENGINE_ARGS, deploy, replica_stats

APP_NAME = "speculative"
PREFIX = "/speculative"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2}
PROMPT = "one two three four one two three four one two"


@pytest.fixture(scope="module")
def spec_app(cluster, tiny_model_dir):
    from ray import serve
    deploy(dict(model=tiny_model_dir, num_replicas=1, replica_num_cpus=0.5, num_threads=1,
                api_keys=API_KEY, dtype="float32", speculative_config=json.dumps(SPEC),
                **ENGINE_ARGS), APP_NAME, PREFIX)
    yield f"{cluster.base_url}{PREFIX}"
    serve.delete(APP_NAME)


def test_streamed_speculative_completion_matches_plain_decoding(spec_app, tiny_model_dir):
    from openai import OpenAI

    from pagedserve import LLM, SamplingParams
    plain = LLM(tiny_model_dir, num_threads=1, dtype="float32", **ENGINE_ARGS)
    expected = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    client = OpenAI(base_url=f"{spec_app}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    stream = client.completions.create(model=ENGINE_ARGS["served_model_name"], prompt=PROMPT,
                                       max_tokens=64, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    deltas = [c.choices[0].text for c in stream if c.choices]
    assert "".join(deltas) == expected.text
    whole = client.completions.create(model=ENGINE_ARGS["served_model_name"], prompt=PROMPT,
                                      max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected.text and whole.usage.completion_tokens == 64
    (stats,) = replica_stats(APP_NAME, 1).values()
    assert stats["spec_decode_num_drafts"] > 0
    assert 0 <= stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
