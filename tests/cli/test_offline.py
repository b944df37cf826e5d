"""`pagedserve generate` / `chat`: the offline engine on the same engine flags."""
from __future__ import annotations

import io

from pagedserve import cli

ENGINE_FLAGS = ["--num-kv-blocks", "32", "--max-model-len", "128", "--num-threads", "1"]


def test_generate_prints_the_offline_llm_greedy_completion(tiny_model_dir, capsys):
    from pagedserve import LLM, SamplingParams

    assert cli.main(["generate", tiny_model_dir, "--prompt", "hello world", "--max-tokens", "6",
                     *ENGINE_FLAGS]) == 0
    printed = capsys.readouterr().out
    llm = LLM(tiny_model_dir, num_kv_blocks=32, max_model_len=128, num_threads=1)
    (expected,) = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6),
                               use_tqdm=False)
    assert printed == "hello world" + expected.outputs[0].text + "\n\n"


def test_chat_answers_a_turn_per_line(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nthe quick fox\n"))
    assert cli.main(["chat", tiny_model_dir, "--max-tokens", "4", *ENGINE_FLAGS]) == 0
    assert len(capsys.readouterr().out.splitlines()) >= 2


def test_bench_runs_the_bench_module_with_its_arguments(capsys, monkeypatch):
    import pytest

    from tests.serve.conftest import REPO

    monkeypatch.chdir(REPO)
    monkeypatch.setattr("sys.argv", ["pagedserve"])
    with pytest.raises(SystemExit) as exc:  # argparse's --help exit, inside bench.offline_throughput
        cli.main(["bench", "throughput", "--help"])
    assert exc.value.code == 0
    assert "Offline throughput" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no module bench.nothing_here"):
        cli.main(["bench", "nothing_here"])
