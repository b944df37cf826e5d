"""The thinking split from the answer: streamed in any deltas it joins to the whole split, tags cut
across deltas are never emitted in part, and each family starts where the engine's gate does."""
import pytest

from pagedserve.replicas.core.reasoning import FORMATS
from pagedserve.serve_app.reasoning import ReasoningSplitter

R1, QWEN3 = FORMATS["deepseek_r1"], FORMATS["qwen3"]


def streamed(fmt, at_start: bool, text: str, cuts: list[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(fmt, at_start)
    reasoning = content = ""
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        r, c = splitter.feed(text[a:b])
        assert "</think>" not in r  # the end tag is never part of the thinking
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("fmt,at_start,text,want", [
    (R1, True, "plan it</think>\n\n{\"a\": 1}", ("plan it", "\n\n{\"a\": 1}")),
    (R1, True, "<think>plan</think>answer", ("plan", "answer")),  # an older template's own tag
    (R1, True, "still thinking", ("still thinking", None)),  # cut off inside the thinking
    (R1, False, "answer </think> as text", (None, "answer </think> as text")),  # closed prompt
    (QWEN3, False, "<think>plan</think>answer", ("plan", "answer")),
    (QWEN3, False, "answer at once", (None, "answer at once")),
    (QWEN3, False, "a </think> b", (None, "a </think> b")),
    (QWEN3, False, "<thin", (None, "<thin")),
    (QWEN3, True, "plan</think>", ("plan", None)),
])
def test_whole_and_streamed_splits_agree(fmt, at_start, text, want):
    assert ReasoningSplitter(fmt, at_start).split(text) == want
    want_reasoning, want_content = want[0] or "", want[1] or ""
    for cut in range(len(text) + 1):  # one cut anywhere, and every character alone
        assert streamed(fmt, at_start, text, [cut]) == (want_reasoning, want_content)
    assert streamed(fmt, at_start, text, list(range(1, len(text)))) == (want_reasoning, want_content)


def test_partial_end_tag_is_held_until_it_resolves():
    splitter = ReasoningSplitter(R1, True)
    assert splitter.feed("abc</th") == ("abc", "")
    assert splitter.feed("ink>x") == ("", "x")
    splitter = ReasoningSplitter(R1, True)
    assert splitter.feed("abc</th") == ("abc", "")
    assert splitter.feed("e end") == ("</the end", "")


def test_thinking_at_start_reads_the_prompt_text():
    assert R1.thinking_at_start("user: hi\nassistant:", "<think>", "</think>")
    assert not QWEN3.thinking_at_start("user: hi\nassistant:", "<think>", "</think>")
    closed = "assistant:<think>\n\n</think>\n\n"
    assert not R1.thinking_at_start(closed, "<think>", "</think>")
    assert QWEN3.thinking_at_start("assistant:<think>\n", "<think>", "</think>")
