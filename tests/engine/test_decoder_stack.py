"""Steps through every layer in one native call (kernels/decoder_layers.py): bit for bit the layer
loop's hidden states and KV cache writes, for the quantized and dense models it takes, and the
layer loop kept for everything else."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from pagedserve.kernels import decoder_layers, native
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve import LLM, SamplingParams
from pagedserve.replicas.models.loader import load_model
from tests import quant_checkpoints as qc
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native CPU kernels")

BLOCK_SIZE = 4
PROMPT_LENS = [5, 9, 16]  # the last decodes into a fresh block at once


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    common = dict(hidden_size=256, num_heads=4, num_kv_heads=2)
    llama = build_tiny_model(root / "llama", "llama", seed=21, **common)
    qwen2 = build_tiny_model(root / "qwen2", "qwen2", seed=22, tie_word_embeddings=True, **common)
    out = {"dense": llama}
    out["gguf-q4_1"] = qc.write_gguf(llama, root / "q4_1.gguf", weight_type="Q4_1",
                                     embedding_type="Q8_0")[0]
    out["gguf-q8_0"] = qc.write_gguf(llama, root / "q8_0.gguf", weight_type="Q8_0")[0]
    for name, source, options in (("gptq-qwen2-biases", qwen2, dict(bits=4, group_size=32)),
                                  ("gptq-act-order", llama, dict(bits=4, group_size=64, desc_act=True))):
        qc.write_gptq(source, root / name, **options)
        out[name] = root / name
    for name, change in (("gelu-mlp", {"hidden_act": "gelu"}), ("sliding-window", {"sliding_window": 8})):
        out[name] = shutil.copytree(llama, root / name)
        config = json.loads((out[name] / "config.json").read_text())
        (out[name] / "config.json").write_text(json.dumps({**config, **change}))
    return out


# Each step's query length per sequence: the three prompts prefill, decode, then a fourth
# sequence's prompt arrives in two chunks (the second over its first's cached keys) beside the
# decodes, and all four decode.
STEPS = [PROMPT_LENS, [1, 1, 1], [1, 1, 1, 6], [1, 1, 1, 7], [1, 1, 1, 1]]


def _steps(model, kv_dtype, steps=STEPS):
    """Yields each step's operands (ids, positions, caches, metadata; the caches as they are
    before it) for the query lengths of `steps`."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = 32
    caches = [torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE), dtype=kv_dtype)
              for _ in range(model.num_layers)]
    blocks = list(range(num_blocks))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * 8:(i + 1) * 8] for i in range(4)]
    lens: list[int] = []
    for query_lens in steps:
        lens = [n + q for n, q in zip(lens, query_lens)] + query_lens[len(lens):]
        metadata = AttentionMetadata.build(query_lens, lens, tables[:len(lens)], BLOCK_SIZE)
        ids = torch.randint(3, model.vocab_size, (sum(query_lens),), generator=gen)
        positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, query_lens)])
        yield ids, positions, caches, metadata


def _decode_step(model):
    """The operands of a decode step after the prompts' prefill (through the model)."""
    steps = _steps(model, torch.float32)
    model(*next(steps))
    return next(steps)


def _forward_both_ways(model, ids, positions, caches, metadata):
    stack = model.model.decoder_stack
    looped = [c.clone() for c in caches]
    model.model.decoder_stack = None
    try:
        expected = model(ids, positions, looped, metadata)
    finally:
        model.model.decoder_stack = stack
    return model(ids, positions, caches, metadata), expected, looped


@pytest.mark.parametrize("name", ["gguf-q4_1", "gguf-q8_0", "gptq-qwen2-biases", "dense"])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.bfloat16)])
def test_every_step_equals_the_layer_loop_bit_for_bit(checkpoints, name, dtype, kv_dtype, monkeypatch):
    """Prefills, decodes, and prompt chunks beside decodes (on a prompt's cached keys too)."""
    model = load_model(checkpoints[name], dtype=dtype)[0]
    stack = model.model.decoder_stack
    if stack is None and dtype is torch.bfloat16 and name == "dense":
        pytest.skip("dense bf16 panels are packed for the native GEMM only with AVX512-BF16")
    assert stack is not None
    ran = []
    run = stack.run
    monkeypatch.setattr(stack, "run", lambda *a: ran.append(run(*a)) or ran[-1])
    for ids, positions, caches, metadata in _steps(model, kv_dtype):
        got, expected, looped = _forward_both_ways(model, ids, positions, caches, metadata)
        assert got.dtype == dtype
        assert torch.equal(got, expected)
        for a, b in zip(caches, looped):
            assert torch.equal(a, b)
    assert len(ran) == len(STEPS) and all(r is not None for r in ran)


@pytest.mark.parametrize("name", ["gguf-q4_1", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_with_lora_rows_equal_the_layer_loop_bit_for_bit(checkpoints, name, dtype, monkeypatch):
    """Rows of two adapters (ranks 4 and 8 in slots of 8) and of the base model in every step:
    the stack adds each projection's deltas where the layer loop's projections do."""
    from pagedserve.replicas.lora.manager import LoRAManager

    model = load_model(checkpoints[name], dtype=dtype)[0]
    manager = LoRAManager(model, max_loras=2, max_rank=8, max_cpu_loras=None, dtype=model.dtype,
                          device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for slots in manager.slots.values():
        for part, (start, stop) in enumerate(slots.parts):
            for slot, rank in ((0, 4), (1, 8)):
                a = torch.randn(rank, slots.lora_a[part].shape[2], generator=gen) * 0.1
                slots.set(slot, part, a.to(dtype), (torch.randn(rank, stop - start, generator=gen)
                                                   * 0.1).to(dtype))
    stack = model.model.decoder_stack
    if stack is None:  # bf16 panels need AVX512-BF16; the test above holds the stack to building
        pytest.skip("this CPU level builds no decoder stack for these weights")
    assert stack._lora is not None
    ran = []
    run = stack.run
    monkeypatch.setattr(stack, "run", lambda *a: ran.append(run(*a)) or ran[-1])
    for ids, positions, caches, metadata in _steps(model, dtype):
        manager.step.token_slots = torch.tensor([(i % 3) - 1 for i in range(len(ids))], dtype=torch.int32)
        got, expected, looped = _forward_both_ways(model, ids, positions, caches, metadata)
        assert torch.equal(got, expected)
        for a, b in zip(caches, looped):
            assert torch.equal(a, b)
    manager.step.token_slots = None
    assert len(ran) == len(STEPS) and all(r is not None for r in ran)


def test_prefills_keep_the_layer_loop_where_the_prefill_kernel_lacks_the_head_dim(tmp_path, monkeypatch):
    """head_dim 40: decode attention takes it, the native prefill attention does not (nor, then,
    the layer loop's), so only all-decode steps go through the stack."""
    path = build_tiny_model(tmp_path / "hd40", "llama", seed=23, hidden_size=80, num_heads=2,
                            num_kv_heads=1)
    model = load_model(path, dtype="float32")[0]
    stack = model.model.decoder_stack
    assert stack is not None and not stack.takes_prefills
    ran = []
    run = stack.run
    monkeypatch.setattr(stack, "run", lambda *a: ran.append(run(*a)) or ran[-1])
    for ids, positions, caches, metadata in _steps(model, torch.float32):
        got, expected, _ = _forward_both_ways(model, ids, positions, caches, metadata)
        assert torch.equal(got, expected)
    assert [r is not None for r in ran] == [q == [1] * len(q) for q in STEPS]


@pytest.mark.parametrize("name", ["gptq-act-order", "gelu-mlp", "sliding-window"])
def test_models_it_does_not_take_keep_the_layer_loop(checkpoints, name):
    model = load_model(checkpoints[name], dtype="float32")[0]
    assert model.model.decoder_stack is None


def test_the_setting_turns_it_off(checkpoints, monkeypatch):
    monkeypatch.setenv(decoder_layers.ENV, "0")
    assert load_model(checkpoints["gguf-q4_1"], dtype="float32")[0].model.decoder_stack is None


def test_operands_it_does_not_take_are_left_to_the_layer_loop(checkpoints):
    model = load_model(checkpoints["gguf-q4_1"], dtype="float32")[0]
    stack = model.model.decoder_stack
    ids, positions, caches, metadata = _decode_step(model)
    hidden = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(positions)
    assert stack.run(hidden.bfloat16(), cos, sin, caches, metadata) is None  # another dtype
    assert stack.run(hidden, cos, sin, caches[:-1], metadata) is None  # a cache short
    assert stack.run(hidden, cos, sin, [c.bfloat16() for c in caches[:1]] + caches[1:], metadata) is None
    assert stack.run(hidden[:2], cos[:2], sin[:2], caches, metadata) is None  # rows != sequences


def test_a_bad_block_table_is_an_error_not_a_stray_read(checkpoints):
    model = load_model(checkpoints["gguf-q4_1"], dtype="float32")[0]
    ids, positions, caches, metadata = _decode_step(model)
    metadata.block_tables[1, 0] = 10_000
    with pytest.raises(ValueError, match="block table entry"):
        model(ids, positions, caches, metadata)
    metadata.block_tables[1, 0] = 0
    metadata.slot_mapping[0] = 10_000_000
    with pytest.raises(ValueError, match="slot_mapping"):
        model(ids, positions, caches, metadata)


def test_the_engine_generates_the_same_with_and_without_it(checkpoints, monkeypatch):
    """Batched decodes, preemption (a small cache) and logprobs through LLM, both ways."""
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in (3, 11, 20, 7)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv(decoder_layers.ENV, setting)
        llm = LLM(str(checkpoints["gguf-q4_1"]), num_kv_blocks=8, block_size=8, dtype="float32")
        assert (llm.llm_engine.runner.model.model.decoder_stack is not None) == (setting == "1")
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]
