"""The flag -> setting mapping: vLLM's flags and units become the settings `serve run` takes."""
from __future__ import annotations

import pytest

from pagedserve import cli, flags, parser
from pagedserve.catalog import catalog
from pagedserve.serve_app.config import ServeSettings


def parse(argv: list[str]) -> dict:
    settings = catalog()
    ns, unknown = parser.build_parser(settings).parse_known_args(["serve", *argv])
    assert unknown == []
    return parser.settings_args(ns, settings)


def test_vllm_flags_build_the_same_settings_as_serve_run_arguments():
    args = parse(["/models/m", "--served-model-name", "m", "--max-num-seqs", "8",
                  "--max-model-len", "2K", "--max-num-batched-tokens", "4k", "--block-size", "32",
                  "--dtype", "half", "--seed", "7", "--no-enable-prefix-caching",
                  "--kv-cache-memory", "2GiB", "--api-key", "a", "--api-key", "b",
                  "--host", "0.0.0.0", "--port", "8001", "-dp", "2", "--max-replicas", "4",
                  "--target-queue-depth", "2.5", "--request-router-kwargs", '{"min_affinity_blocks": 2}',
                  "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"])
    from_flags = ServeSettings.from_args(args, env={})
    from_serve_run = ServeSettings.from_args(dict(
        model="/models/m", served_model_name="m", max_num_seqs="8", max_model_len="2048",
        max_num_batched_tokens="4000", block_size="32", dtype="float16", seed="7",
        enable_prefix_caching="false", kv_cache_memory_gb="2", api_keys="a,b", host="0.0.0.0",
        port="8001", num_replicas="2", max_replicas="4", target_queue_depth="2.5",
        request_router_kwargs='{"min_affinity_blocks": 2}', tensor_parallel_size="2",
        distributed_executor_backend="ray"), env={})
    assert from_flags == from_serve_run
    assert from_flags.model_fields_set == from_serve_run.model_fields_set


def test_vllm_lora_flags_build_the_lora_settings():
    args = parse(["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras",
                  "8", "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat"}',
                  "--allow-runtime-lora-updating"])
    settings = ServeSettings.from_args(args, env={})
    engine = settings.engine
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == \
        (True, 4, 64, 8)
    assert settings.lora_adapters == {"sql": "/a/sql", "chat": "/a/chat"}
    assert settings.allow_runtime_lora_updating
    assert ServeSettings.from_args({"enable_lora": "true"},
                                   env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
                                   ).allow_runtime_lora_updating
    with pytest.raises(ValueError, match="need enable_lora"):
        ServeSettings.from_args({"lora_modules": "sql=/a/sql"}, env={})
    with pytest.raises(ValueError, match="given twice"):
        ServeSettings.from_args({"enable_lora": "true", "lora_modules": "a=/x a=/y"}, env={})


def test_vllm_speculative_config_flag_builds_the_setting():
    args = parse(["--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    spec = ServeSettings.from_args(args, env={}).engine.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
            spec.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert ServeSettings.from_args({}, env={}).engine.speculative_config is None
    with pytest.raises(ValueError, match="draft model"):
        ServeSettings.from_args({"speculative_config": '{"model": "/d", "num_speculative_tokens": 2}'},
                                env={})


def test_vllm_tool_call_flags_are_accepted_and_set_nothing():
    # `vllm serve M --enable-auto-tool-choice --tool-call-parser hermes` works unchanged.
    assert parse(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == parse([])


def test_unset_flags_leave_the_settings_defaults():
    assert parse([]) == {}
    assert ServeSettings.from_args(parse([]), env={}) == ServeSettings.from_args({}, env={})


def test_every_setting_of_both_models_has_a_flag():
    from pagedserve.replicas.config import EngineConfig

    settings = {s.name: s for s in catalog()}
    expected = set(EngineConfig.model_fields) | set(ServeSettings.model_fields) - {"engine"}
    assert set(settings) == expected
    for setting in settings.values():
        assert setting.flag_names, setting.name
        assert setting.meaning, f"{setting.name} has no meaning to show"


@pytest.mark.parametrize("text, expected", [("2048", 2048), ("2k", 2000), ("2K", 2048),
                                            ("1m", 10 ** 6), ("1M", 2 ** 20)])
def test_human_int(text, expected):
    assert flags.human_int(text) == expected


@pytest.mark.parametrize("text, gib", [("4GiB", 4.0), ("4G", 4.0), ("512MiB", 0.5),
                                       (str(2 ** 30), 1.0), ("2g", 2e9 / 2 ** 30)])
def test_kv_cache_memory_bytes(text, gib):
    assert flags.bytes_to_gib(text) == pytest.approx(gib)


def test_kv_cache_memory_refuses_a_number_that_looks_like_gib():
    with pytest.raises(ValueError, match="in bytes"):
        flags.bytes_to_gib("4")


@pytest.mark.parametrize("argv, words", [
    (["--trust-remote-code"], ["--trust-remote-code", "not supported", "remote code"]),
    (["--swap-space", "4"], ["--swap-space", "not supported"]),
    (["--no-such-flag=3"], ["unknown flag --no-such-flag"]),
    (["--pipeline-parallel-size", "2"], ["--pipeline-parallel-size 2", "--num-replicas"]),
    (["--tool-call-parser", "mistral"], ["--tool-call-parser mistral", "only hermes"]),
    (["--max-num-seqs", "zero"], ["--max-num-seqs", "integer"]),
    (["--max-num-seqs"], ["--max-num-seqs", "expected one argument"]),
    (["--num-replicas", "0"], ["num_replicas"]),
    (["--request-router-kwargs", '{"colour": 1}'], ["colour"]),
    (["/no/such/model"], ["/no/such/model", "not a local model"]),
    (["/a", "--model", "/b"], ["model is given twice"]),
])
def test_bad_flags_exit_2_with_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for word in words:
        assert word in err


def test_vllm_flags_for_features_not_here_say_so(capsys):
    known = {s.name for s in catalog()}
    pending = [f for f in flags.VLLM_FLAGS if f.setting not in known]
    if not pending:
        pytest.skip("every mapped vLLM flag has its setting")
    with pytest.raises(SystemExit):
        cli.main(["serve", pending[0].vllm[0]])
    assert "not supported by this pagedserve version" in capsys.readouterr().err
