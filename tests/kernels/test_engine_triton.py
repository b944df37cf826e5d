"""The whole engine on the Triton backend (the interpreter on CPU) gives the torch backend's tokens."""
from pagedserve import LLM, SamplingParams
from tests.tiny_models import build_tiny_model


def test_engine_greedy_tokens_triton_equals_torch(tmp_path):
    model_dir = str(build_tiny_model(tmp_path / "llama", "llama", num_layers=1, max_position_embeddings=128))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # A small token budget forces a chunked prefill next to decodes, and a prefix hit.
    # float32: bf16 (auto on AVX512-BF16 CPUs) rounds differently in the two backends
    args = dict(max_model_len=128, max_num_batched_tokens=24, num_kv_blocks=32, dtype="float32")
    expected = LLM(model_dir, attention_backend="torch", **args).generate(prompts, params, use_tqdm=False)
    triton_llm = LLM(model_dir, attention_backend="triton", **args)
    assert triton_llm.llm_engine.runner.model.attention_backend.name == "triton"
    got = triton_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_engine_sliding_window_triton_equals_torch(tmp_path):
    import json

    model_dir = build_tiny_model(tmp_path / "mistral", "mistral", num_layers=1, max_position_embeddings=128)
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 12  # shorter than the prompts: blocks are dropped as they run
    (model_dir / "config.json").write_text(json.dumps(config))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    args = dict(max_model_len=128, max_num_batched_tokens=24, num_kv_blocks=32, block_size=8,
                dtype="float32")
    expected = LLM(str(model_dir), attention_backend="torch", **args).generate(prompts, params, use_tqdm=False)
    triton_llm = LLM(str(model_dir), attention_backend="triton", **args)
    assert triton_llm.llm_engine.block_manager.sliding_window == 12
    got = triton_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
