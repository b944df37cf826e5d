"""The engine protocol (replicas/engine/protocol.py): every message type crosses the codec intact, frames
split across reads come out whole, and what is not a message of ours is refused."""
from __future__ import annotations

import msgspec
import pytest

from pagedserve.replicas.engine import protocol
from pagedserve.replicas.core.cache_digest import StepReport
from pagedserve.replicas.core.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.replicas.core.sampling_params import (
    RequestOutputKind, SamplingParams, StructuredOutputsParams,
)

PARAMS = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["\n", "END"],
                        stop_token_ids=[7], logit_bias={5: -1.5}, max_tokens=20, min_tokens=2,
                        logprobs=2, output_kind=RequestOutputKind.DELTA, detokenize=False,
                        structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
OUTPUT = RequestOutput(
    "r1", None, [1, 2, 3],
    [CompletionOutput(0, "", [4, 5], -1.25, [{4: Logprob(-0.5, 1, None)},
                                              {5: Logprob(-0.75, 1), 6: Logprob(-1.0, 2)}]),
     CompletionOutput(1, "", [9], None, None, "stop", 7)],
    finished=False, prompt_logprobs=[None, {2: Logprob(-3.0, 4, "b")}], num_cached_tokens=16,
    num_prompt_tokens=3, metrics={"arrival_time": 1.5}, embedding=None)

MESSAGES = [
    protocol.Hello(protocol.PROTOCOL_VERSION, "t" * 32, "client"),
    protocol.AddRequest("r1", [1, 2, 3], PARAMS, priority=-1, block_hashes=[2**63 - 1, -5]),
    protocol.AddRequest("r2", [1], SamplingParams()),
    protocol.Abort(["r1", "r2"]),
    protocol.QueuedHere(4),
    protocol.CoreOutputs([OUTPUT], [protocol.Failure("r2", protocol.INVALID, "bad", "prompt")],
                         StepReport(12.5, 3, 40, 2), {"version": 2, "kv_events": None},
                         draining=True),
    protocol.CoreOutputs([]),
    protocol.Start({"model": None}, "127.0.0.1", 8, 5.0, "m:C"),
    protocol.Ready({"model_name": "m", "tokenizer": b"\x00\x01"}),
    protocol.StartFailed("ValueError: x", "Traceback ..."),
    protocol.Stats({"num_requests": 1, "kv_cache_usage": 0.5}),
    protocol.Died("RuntimeError: boom"),
    protocol.Drain(),
    protocol.Stop(),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    to_core = isinstance(message, protocol.ToCore.__args__)
    reader = protocol.core_reader() if to_core else protocol.client_reader()
    (back,) = reader.feed(protocol.frame(message))
    assert type(back) is type(message)
    assert back == message


def test_sampling_params_cross_intact_and_are_checked_again():
    (back,) = protocol.core_reader().feed(protocol.frame(MESSAGES[1]))
    assert back.params == PARAMS and back.params.output_kind is RequestOutputKind.DELTA
    assert back.params.logit_bias == {5: -1.5}
    bad = protocol.AddRequest("r", [1], SamplingParams())
    bad.params.top_p = 7.0  # what no ingress of ours sends: refused where it is decoded
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        protocol.core_reader().feed(protocol.frame(bad))


def test_messages_are_positional_on_the_wire():
    assert msgspec.msgpack.decode(protocol.frame(protocol.Abort(["a"]))[4:]) == ["Abort", ["a"]]


def test_frames_split_across_reads_come_out_whole():
    reader = protocol.client_reader()
    messages = [m for m in MESSAGES if isinstance(m, protocol.FromCore.__args__)]
    data = b"".join(protocol.frame(m) for m in messages)
    got = []
    for i in range(0, len(data), 7):
        got += reader.feed(data[i:i + 7])
    assert got == messages


@pytest.mark.parametrize("frame", [
    b"\x00\x00\x00\x01\xc1",  # not MessagePack
    protocol.frame(protocol.Stats({})),  # a message of the other direction
    b"\xff\xff\xff\xff",  # a frame longer than any message
])
def test_what_is_not_a_message_of_ours_is_refused(frame):
    with pytest.raises(ValueError):
        protocol.core_reader().feed(frame)
