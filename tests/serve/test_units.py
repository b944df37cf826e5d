"""The serving layer's pure parts, without Ray: settings, errors, deltas, chunk shapes."""
from __future__ import annotations

import asyncio
import pickle

import pytest

from pagedserve.replicas.core.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.serve_app.config import ServeSettings
from pagedserve.serve_app.errors import OpenAIError, from_validation_error
from pagedserve.serve_app.protocol import ChatCompletionRequest, CompletionRequest


def test_settings_split_engine_and_serving_keys():
    s = ServeSettings.from_args({"model": "/m", "max_num_seqs": "8", "num_replicas": "2",
                                 "api_keys": "a, b", "enable_prefix_caching": "false"}, env={})
    assert s.engine.model == "/m" and s.engine.max_num_seqs == 8
    assert s.engine.enable_prefix_caching is False and s.engine.num_threads == 1
    assert s.num_replicas == 2 and s.api_keys == ["a", "b"]
    assert s.core_max_requests == 8 and s.replica_cpus == 1.0  # a core holds its batch
    assert ServeSettings.from_args({"replica_max_ongoing_requests": "12"},
                                   env={}).core_max_requests == 12


def test_settings_keys_from_environment_and_nested_engine():
    s = ServeSettings.from_args({"engine": {"block_size": 32}}, env={"PAGEDSERVE_API_KEYS": "k1,k2"})
    assert s.api_keys == ["k1", "k2"] and s.engine.block_size == 32
    assert ServeSettings.from_args({"api_keys": ""}, env={"PAGEDSERVE_API_KEYS": "k"}).api_keys == []


@pytest.mark.parametrize("args, needle", [
    ({"modle": "x"}, "unknown setting(s) modle"),
    ({"max_num_seqs": "zero"}, "max_num_seqs"),
    ({"num_replicas": "0"}, "num_replicas"),
    ({"min_replicas": "3", "max_replicas": "2"}, "min_replicas"),
])
def test_bad_settings_fail_with_the_name(args, needle):
    with pytest.raises(ValueError, match=None) as info:
        ServeSettings.from_args(args, env={})
    assert needle in str(info.value)


def test_openai_error_survives_pickling_and_renders():
    err = pickle.loads(pickle.dumps(OpenAIError("slow down", 429, code="engine_overloaded",
                                                retry_after_s=3)))
    assert (err.status_code, err.type, err.code, err.retry_after_s) == (429, "rate_limit_exceeded",
                                                                        "engine_overloaded", 3)
    response = err.to_response()
    assert response.status_code == 429 and response.headers["retry-after"] == "3"


def test_validation_errors_name_the_field():
    from pydantic import ValidationError
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "temperature": 9})
    err = from_validation_error(info.value.errors())
    assert err.status_code == 400 and err.param == "temperature" and "temperature" in err.message


def test_sampling_params_carry_vllm_extras():
    req = CompletionRequest(prompt="x", temperature=0, top_k=5, min_p=0.1, repetition_penalty=1.2,
                            ignore_eos=True, min_tokens=2, stop="\n", logit_bias={"7": 2.0}, seed=3)
    params = req.sampling_params(max_tokens=8, logprobs=None)
    assert params.is_greedy and params.ignore_eos and params.min_tokens == 2
    assert params.repetition_penalty == 1.2 and params.stop == ["\n"] and params.logit_bias == {7: 2.0}


def delta(texts, tokens, finish=None, request_id="r"):
    return RequestOutput(request_id, None, [], [
        CompletionOutput(i, t, list(tok), finish_reason=finish)
        for i, (t, tok) in enumerate(zip(texts, tokens))], finished=finish is not None,
        num_cached_tokens=2, num_prompt_tokens=3)


def test_request_output_add_folds_deltas_per_completion():
    first = delta(["a"], [[5]])
    first.add(RequestOutput("r", None, [], [CompletionOutput(1, "x", [9])], num_prompt_tokens=3))
    first.add(delta(["bc", "y"], [[6, 7], [10]], finish="length"))
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in first.outputs] == [
        (0, "abc", [5, 6, 7], "length"), (1, "xy", [9, 10], "length")]
    assert first.finished and first.num_cached_tokens == 2


def test_output_queue_hands_a_late_consumer_one_folded_output():
    from pagedserve.serve_app.output_queue import OutputQueue

    async def run():
        queue = OutputQueue()
        queue.put(delta(["He"], [[1]]))
        queue.put(delta(["l"], [[2]]))
        queue.put(delta(["lo"], [[3]], finish="stop"))
        queue.put(delta(["ignored"], [[4]]))  # after the end
        return [o async for o in queue]

    outputs = asyncio.run(run())
    assert len(outputs) == 1 and outputs[0].outputs[0].text == "Hello"
    assert outputs[0].outputs[0].token_ids == [1, 2, 3] and outputs[0].finished


def test_output_queue_raises_a_pending_error():
    from pagedserve.serve_app.output_queue import OutputQueue

    async def run():
        queue = OutputQueue()
        queue.put(delta(["a"], [[1]]))
        queue.put(ValueError("boom"))
        return await queue.get()

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(run())


@pytest.mark.parametrize("text", ["hi", 'a\nb\t"q"\\', "é日本🙂", "\u2028\x00\x1f\x7f", ""])
def test_sse_text_events_are_the_models_bytes(text):
    from pagedserve.serve_app.formatters import ChatFormatter, CompletionFormatter
    from pagedserve.serve_app.protocol import (
        ChatCompletionStreamResponse, ChatStreamChoice, CompletionChoice, CompletionStreamResponse,
        DeltaMessage,
    )

    class Info:
        name, tokenizer, reasoning_parser = "my-model", None, None

    completion = CompletionRequest(prompt="x", stream=True)
    f = CompletionFormatter(completion, Info, "cmpl-1", ["x"], sse=True)
    expected = CompletionStreamResponse(id="cmpl-1", created=f.created, model="my-model",
                                        choices=[CompletionChoice(index=3, text=text)])
    assert f._text_event(3, text) == f"data: {expected.model_dump_json()}\n\n"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True)
    g = ChatFormatter(chat, Info, "chatcmpl-1", sse=True)
    expected = ChatCompletionStreamResponse(id="chatcmpl-1", created=g.created, model="my-model",
                                            choices=[ChatStreamChoice(index=3,
                                                                      delta=DeltaMessage(content=text))])
    assert g._text_event(3, text) == f"data: {expected.model_dump_json()}\n\n"


def test_chat_stream_chunk_order():
    from pagedserve.serve_app.formatters import ChatFormatter

    class Info:
        name, tokenizer, reasoning_parser = "m", None, None

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], stream=True,
                                    stream_options={"include_usage": True})
    deltas = [RequestOutput("r", None, [], [CompletionOutput(0, "Hel", [1])], num_prompt_tokens=4),
              RequestOutput("r", None, [], [CompletionOutput(0, "lo", [2], finish_reason="stop")],
                            finished=True, num_prompt_tokens=4)]

    async def merged():
        for d in deltas:
            yield 0, d

    async def collect():
        return [c async for c in ChatFormatter(request, Info, "chatcmpl-1").stream(merged())]

    chunks = asyncio.run(collect())
    dumped = [c.model_dump() for c in chunks]
    assert dumped[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in dumped[1:3]] == ["Hel", "lo"]
    assert dumped[3]["choices"][0]["delta"] == {} and dumped[3]["choices"][0]["finish_reason"] == "stop"
    assert dumped[4]["choices"] == [] and dumped[4]["usage"]["completion_tokens"] == 2
    assert dumped[4]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_logprob_shapes():
    from pagedserve.serve_app.responses import LogprobFormatter

    position = {5: Logprob(-0.1, 1, "a"), 6: Logprob(-2.0, 2, "b"), 7: Logprob(-3.0, 3, "c")}
    fmt = LogprobFormatter(tokenizer=None, num_top=2)
    completion = fmt.completion([5], [position], text_offset=10)
    assert completion.tokens == ["a"] and completion.text_offset == [10]
    assert completion.top_logprobs == [{"a": -0.1, "b": -2.0}]
    chat = fmt.chat([6], [{6: Logprob(-2.0, 2, "b"), 5: Logprob(-0.1, 1, "a")}])
    assert chat.content[0].token == "b" and [t.token for t in chat.content[0].top_logprobs] == ["a", "b"]


def test_replica_counts_autoscaling_and_routing_are_not_ingress_constructor_arguments():
    """Ray Serve updates a deployment in place (no restart, no cut stream) when only its options
    change: settings that steer the engine replicas must not reach the ingress's arguments."""
    from pagedserve.serve_app import build_app

    def ingress_args(**changes):
        return build_app({"model": None, **changes})._bound_deployment.init_args[2]

    base = ingress_args()
    for changes in ({"num_replicas": 3}, {"min_replicas": 1, "max_replicas": 4},
                    {"target_queue_depth": 8}, {"max_queued_requests": 5},
                    {"request_router_kwargs": '{"load_override_threshold": 2}'},
                    {"replica_max_ongoing_requests": 7}, {"graceful_shutdown_timeout_s": 90}):
        assert ingress_args(**changes) == base, changes
    assert ingress_args(api_keys="k")["api_keys"] == ["k"]  # what the ingress does use, it gets


def test_the_ingress_takes_its_router_and_queue_settings_in_place():
    """The router and the admission queue are the ingress's own: their settings are its
    user_config, which Ray Serve applies to running replicas (`Ingress.reconfigure`)."""
    from pagedserve.serve_app.app import ingress_options

    s = ServeSettings.from_args({"max_queued_requests": "5",
                                 "request_router_kwargs": '{"load_override_threshold": 2}'}, env={})
    config = ingress_options(s)["user_config"]
    assert config["max_queued_requests"] == 5
    assert config["routing"] == {"load_override_threshold": 2}
    assert config["scale_from_zero"] is False
    zero = ServeSettings.from_args({"min_replicas": "0", "max_replicas": "2"}, env={})
    assert ingress_options(zero)["user_config"]["scale_from_zero"] is True


def test_the_ingress_drains_as_long_as_the_engine_replicas():
    from pagedserve.serve_app.app import ingress_options, replica_options

    s = ServeSettings.from_args({"min_replicas": 1, "max_replicas": 2}, env={})
    assert ingress_options(s)["graceful_shutdown_timeout_s"] \
        == replica_options(s)["graceful_shutdown_timeout_s"] > 20
