"""LoRA adapters in the engine against peft's PeftModel on transformers: greedy tokens equal,
token for token (float32), for every family, in mixed batches of the base model and adapters of
different ranks, under chunked prefill and preemption, with fewer slots than adapters; a
quantized base against peft on its dequantized weights; errors that name what is wrong."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from tests import quant_checkpoints as qc
from tests.lora_adapters import peft_model, write_adapter
from tests.tiny_models import FAMILY_CONFIGS, build_tiny_family, build_tiny_model, hf_greedy

PROMPT_LENS = [1, 3, 9, 17, 24, 33]
MAX_TOKENS = [8, 5, 10, 8, 6, 10]
MODES = {
    "default": dict(num_kv_blocks=64),
    "chunked_32": dict(num_kv_blocks=64, max_num_batched_tokens=32),
    "preempted": dict(num_kv_blocks=5, max_num_batched_tokens=32),
}
RANKS = (4, 8, 16)  # the three adapters of the mixed batch


def greedy(max_tokens):
    return [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens]


def prompts_for(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama, three adapters of different ranks, and the reference tokens of each."""
    root = tmp_path_factory.mktemp("lora-llama")
    base = build_tiny_model(root / "base", "llama")
    adapters = [write_adapter(base, root / f"r{r}", rank=r, seed=r, use_rslora=r == 16)
                for r in RANKS]
    prompts = prompts_for(384)
    expected = {None: hf_greedy(peft_model(base, None), prompts, MAX_TOKENS)}
    for i, path in enumerate(adapters):
        expected[i + 1] = hf_greedy(peft_model(base, path), prompts, MAX_TOKENS)
    loras = [LoRARequest(f"adapter-{r}", i + 1, str(p)) for i, (r, p) in enumerate(zip(RANKS, adapters))]
    return SimpleNamespace(base=str(base), loras=loras, prompts=prompts, expected=expected)


def mixed(llama):
    """Every prompt once per model (base + each adapter), interleaved in one batch."""
    cases = [(lora, i) for i in range(len(llama.prompts)) for lora in (None, *llama.loras)]
    return ([{"prompt_token_ids": llama.prompts[i]} for _, i in cases],
            greedy([MAX_TOKENS[i] for _, i in cases]), [lora for lora, _ in cases],
            [llama.expected[lora.lora_int_id if lora else None][i] for lora, i in cases])


def test_the_adapters_change_the_outputs(llama):
    assert all(llama.expected[i] != llama.expected[None] for i in (1, 2, 3))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_mixed_batch_matches_peft_for_every_request(llama, mode):
    llm = LLM(llama.base, attention_backend="torch", dtype="float32", enable_lora=True, max_loras=3,
              **MODES[mode])
    prompts, params, loras, expected = mixed(llama)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.llm_engine.stats()
    if mode == "preempted":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_more_adapters_than_slots_wait_for_one_and_all_match(llama):
    llm = LLM(llama.base, attention_backend="torch", dtype="float32", enable_lora=True, max_loras=1,
              max_cpu_loras=2, num_kv_blocks=64)
    prompts, params, loras, expected = mixed(llama)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.llm_engine.stats()
    assert stats["lora_slot_loads"] >= 3 and stats["lora_evictions"] >= 1
    assert len(stats["lora_resident"]) <= 2


def test_the_default_single_slot_serves_two_adapters_of_one_request_each(llama):
    """max_loras=1, one adapter in memory: B's request arrives while A's runs; neither fails."""
    llm = LLM(llama.base, attention_backend="torch", dtype="float32", enable_lora=True,
              num_kv_blocks=64)
    first, second = llama.loras[:2]
    outputs = llm.generate([{"prompt_token_ids": llama.prompts[i]} for i in (2, 3)],
                           greedy([MAX_TOKENS[2], MAX_TOKENS[3]]), use_tqdm=False,
                           lora_request=[first, second])
    assert [o.outputs[0].token_ids for o in outputs] == [llama.expected[1][2], llama.expected[2][3]]


def test_adapters_never_share_kv_blocks(llama):
    llm = LLM(llama.base, attention_backend="torch", dtype="float32", enable_lora=True, max_loras=2,
              num_kv_blocks=64)
    prompt = [{"prompt_token_ids": llama.prompts[-1]}]  # 33 tokens: two full blocks
    first, second = llama.loras[:2]
    cached = []
    for lora in (first, first, second, None):
        out = llm.generate(prompt, greedy([1]), use_tqdm=False, lora_request=lora)[0]
        cached.append(out.num_cached_tokens)
    assert cached == [0, 32, 0, 0]


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = build_tiny_family(root / "base", request.param)
    adapter = write_adapter(base, root / "adapter", rank=8, seed=3, family=request.param)
    reference = peft_model(base, adapter)
    prompts = prompts_for(reference.config.vocab_size)
    return SimpleNamespace(name=request.param, base=str(base), adapter=str(adapter), prompts=prompts,
                           expected=hf_greedy(reference, prompts, MAX_TOKENS),
                           base_expected=hf_greedy(peft_model(base, None), prompts, MAX_TOKENS))


def test_every_family_takes_its_adapters(family):
    llm = LLM(family.base, attention_backend="torch", dtype="float32", enable_lora=True,
              num_kv_blocks=64, max_model_len=64 if family.name == "phi3" else None)
    lora = LoRARequest("adapter", 7, family.adapter)
    prompts = [{"prompt_token_ids": p} for p in family.prompts]
    outputs = llm.generate(prompts * 2, greedy(MAX_TOKENS * 2), use_tqdm=False,
                           lora_request=[lora] * len(prompts) + [None] * len(prompts))
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == family.expected + family.base_expected
    assert family.expected != family.base_expected


@pytest.mark.parametrize("fmt", ["gguf-q4_1", "gptq-w4g32"])
def test_an_adapter_on_a_quantized_base_matches_peft_on_its_dequantized_weights(fmt, tmp_path):
    source = build_tiny_model(tmp_path / "source", "llama", hidden_size=256, num_heads=4,
                              num_kv_heads=2, seed=11)
    if fmt == "gguf-q4_1":
        path, state = qc.write_gguf(source, tmp_path / "model.gguf", weight_type="Q4_1",
                                    embedding_type="Q8_0")
    else:
        path, state = tmp_path / "gptq", qc.write_gptq(source, tmp_path / "gptq", bits=4, group_size=32)
    adapter = write_adapter(source, tmp_path / "adapter", rank=8, seed=5, scale=4.0)
    reference = peft_model(source, adapter, state)
    prompts = prompts_for(reference.config.vocab_size, seed=1)
    llm = LLM(str(path), attention_backend="torch", dtype="float32", enable_lora=True,
              num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(MAX_TOKENS),
                           use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    for prompt, n, output in zip(prompts, MAX_TOKENS, outputs):
        want, gaps = qc.greedy_with_gaps(reference, prompt, n)
        qc.assert_greedy_matches_up_to_ties(output.outputs[0].token_ids, want, gaps)


def test_bad_adapters_are_refused_naming_the_problem(llama, tmp_path):
    llm = LLM(llama.base, attention_backend="torch", dtype="float32", enable_lora=True,
              max_lora_rank=8, num_kv_blocks=16)
    engine = llm.llm_engine
    wide = write_adapter(llama.base, tmp_path / "wide", rank=16)
    alien = write_adapter(build_tiny_model(tmp_path / "other", "llama", hidden_size=32), tmp_path / "alien",
                          rank=4)
    corrupt = write_adapter(llama.base, tmp_path / "corrupt", rank=4)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    cases = {wide: "rank 16 is above max_lora_rank=8", alien: "do not fit",
             corrupt: "cannot be read", tmp_path / "missing": "does not exist"}
    for i, (path, message) in enumerate(cases.items()):
        future = engine.load_adapter(LoRARequest("bad", 100 + i, str(path)))
        with pytest.raises(ValueError, match=message):
            future.result()
        with pytest.raises(ValueError, match=message):  # a request for it fails, naming `model`
            llm.generate("hello", greedy([2])[0], use_tqdm=False,
                         lora_request=LoRARequest("bad", 100 + i, str(path)))
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and not engine.requests
    import json
    odd = write_adapter(llama.base, tmp_path / "odd", rank=4)
    config = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": "16"}))
    with pytest.raises(ValueError, match="cannot be read: TypeError"):  # not a crash of the engine
        engine.load_adapter(LoRARequest("odd", 300, str(odd))).result()
    from safetensors.torch import load_file, save_file

    unknown = write_adapter(llama.base, tmp_path / "unknown", rank=4, targets=["q_proj"])
    weights = unknown / "adapter_model.safetensors"
    save_file({k.replace("q_proj", "rotary_proj"): v for k, v in load_file(weights).items()}, weights)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.rotary_proj': the model has no such "
                                         "projection"):
        engine.load_adapter(LoRARequest("x", 200, str(unknown))).result()


def test_a_decoders_embeddings_come_from_its_adapter(llama):
    import numpy as np
    import torch

    llm = LLM(llama.base, attention_backend="torch", dtype="float32", enable_lora=True,
              pooling="last", num_kv_blocks=64)
    lora = llama.loras[1]
    got = np.array([o.outputs.embedding for o in llm.embed(
        [{"prompt_token_ids": p} for p in llama.prompts], use_tqdm=False, lora_request=lora)])
    reference = peft_model(llama.base, lora.lora_path)
    with torch.inference_mode():
        want = np.stack([torch.nn.functional.normalize(reference(
            torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1], dim=0).numpy()
            for p in llama.prompts])
    np.testing.assert_allclose(got, want, atol=1e-4)
    base = np.array([o.outputs.embedding for o in llm.embed(
        [{"prompt_token_ids": p} for p in llama.prompts], use_tqdm=False)])
    assert not np.allclose(base, got, atol=1e-3)


def test_an_adapter_removed_while_its_requests_run_lets_them_finish(llama):
    llm = LLM(llama.base, attention_backend="torch", dtype="float32", enable_lora=True,
              num_kv_blocks=64)
    engine, lora = llm.llm_engine, llama.loras[0]
    index = 3
    engine.add_request("a", {"prompt_token_ids": llama.prompts[index]},
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS[index]), lora_request=lora)
    engine.step()
    engine.step()
    assert not engine.remove_adapter(lora.lora_int_id)  # held by a running request
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].outputs[0].token_ids == llama.expected[1][index]
    assert engine.stats()["lora_resident"] == []  # unloaded: gone once its request ended


def test_lora_requests_need_enable_lora(llama):
    llm = LLM(llama.base, attention_backend="torch", dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate("hi", greedy([2])[0], use_tqdm=False, lora_request=llama.loras[0])
