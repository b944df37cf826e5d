"""The OpenAI SDK against the running app: results equal the offline LLM, streams equal non-streams."""
from __future__ import annotations

import json

import pytest

from pagedserve import SamplingParams
from tests.serve.conftest import MODEL_NAME

PROMPTS = ["hello world", "the quick brown fox jumps over", "paged attention blocks cache prefix",
           "ray serve engine replica router"]
MESSAGES = [{"role": "system", "content": "you are a router"},
            {"role": "user", "content": "what is the capital of france"}]


def greedy(offline_llm, prompt, max_tokens, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return offline_llm.generate([prompt], params, use_tqdm=False)[0]


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model" and models[0].owned_by == "pagedserve"


def test_completion_greedy_equals_offline(client, offline_llm):
    for prompt, max_tokens in zip(PROMPTS, [5, 12, 16, 9]):
        expected = greedy(offline_llm, prompt, max_tokens)
        result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0)
        choice = result.choices[0]
        assert choice.text == expected.outputs[0].text
        assert choice.finish_reason == expected.outputs[0].finish_reason
        assert result.object == "text_completion" and result.id.startswith("cmpl-")
        assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_completion_accepts_token_ids_and_prompt_lists(client, offline_llm):
    ids = offline_llm.get_tokenizer().encode(PROMPTS[1])
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6,
                                        temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[1].text == by_text.choices[0].text


def test_chat_greedy_equals_offline(client, offline_llm):
    expected = offline_llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)[0]
    result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12,
                                            temperature=0)
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)
    # Text parts are accepted too, and max_completion_tokens wins over max_tokens.
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": MESSAGES[1]["content"]}]}]
    again = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=3,
                                           max_completion_tokens=12, temperature=0)
    assert again.choices[0].message.content == choice.message.content


def test_chat_stream_joined_equals_non_stream(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=14, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    final_usage = chunks[-1].usage
    assert chunks[-1].choices == [] and final_usage.prompt_tokens_details is not None
    assert (final_usage.prompt_tokens, final_usage.completion_tokens, final_usage.total_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is chunks[-2]
    assert finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


def test_completion_stream_joined_equals_non_stream(client, http):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=15, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    # The raw stream: `data: {...}` events, then `data: [DONE]`.
    raw = http.post("/v1/completions", json={**kwargs, "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw.text)
    assert "".join(e["choices"][0]["text"] for e in events) == whole.choices[0].text


def test_n2_sampling(client):
    result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8,
                                            temperature=1.0, seed=7)
    assert [c.index for c in result.choices] == [0, 1]
    assert result.usage.completion_tokens == 8 * 2 or all(
        c.finish_reason == "stop" for c in result.choices if c.finish_reason != "length")
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=2, max_tokens=6,
                                            temperature=1.0, seed=7, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=2, max_tokens=6,
                                      temperature=1.0, seed=7)
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]


def test_logprobs(client, offline_llm):
    expected = greedy(offline_llm, PROMPTS[3], 6, logprobs=2).outputs[0]
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=6,
                                       temperature=0, logprobs=2)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # top 2, plus the sampled token
    want = [pos[tid].logprob for tid, pos in zip(expected.token_ids, expected.logprobs)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob for t in content)


def test_stop_strings(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24,
                                    temperature=0, stop=[stop]).choices[0]
    assert cut.text == full[:full.index(stop)]
    assert cut.finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_echo(client):
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4,
                                       temperature=0, echo=True, logprobs=1)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert result.choices[0].text == PROMPTS[0] + plain.choices[0].text
    lp = result.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == result.usage.prompt_tokens + 4


def test_vllm_extras_and_continuous_usage(http):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 10, "ignore_eos": True,
            "repetition_penalty": 1.1, "top_k": 5, "min_p": 0.05, "min_tokens": 2, "temperature": 0.7,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert all(e["usage"] is not None for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 10  # ignore_eos: exactly max_tokens


def test_cached_tokens_reported(client):
    prompt = " ".join(["paged attention blocks cache prefix"] * 12)  # several full blocks
    cached = []
    for _ in range(6):  # two replicas: repeats reach each one's cache
        usage = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                          temperature=0).usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and max(cached) >= 16 and max(cached) < usage.prompt_tokens


def test_tokenize_detokenize(http, offline_llm):
    tokenizer = offline_llm.get_tokenizer()
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPTS[1]}).json()
    assert r["tokens"] == tokenizer.encode(PROMPTS[1]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == tokenizer.decode(r["tokens"])


def test_docs_and_openapi(http):
    assert http.get("/docs").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
            "/detokenize", "/health"} <= set(paths)


def test_prompt_lists_never_wait_on_a_shared_request_id(client, offline_llm):
    # Each prompt of a list is its own replica call; under one shared request id Ray's router
    # could leave one of them unrouted forever (seen as a 60 s timeout). Repeat to hit the race.
    expected = [greedy(offline_llm, p, 3).outputs[0].text for p in PROMPTS]
    for _ in range(8):
        result = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=3,
                                           temperature=0, timeout=30)
        assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == expected
