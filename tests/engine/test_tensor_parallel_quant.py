"""Quantized checkpoints under tensor_parallel_size=2 (gloo, two local processes): greedy tokens
equal tensor_parallel_size=1 on the same checkpoint, logprobs within 1e-4, for GGUF (a quantized,
tied embedding: vocab-split rows and the rank's quantized lm_head), GPTQ with act-order, AWQ and
compressed-tensors W4A16, and for the other families' quantized checkpoints (Gemma 2 and 3,
Mixtral's experts, GPT-NeoX's reordered query_key_value, OPT's row-parallel biases), which also
match transformers on the dequantized weights; QuantWeight's column slice equals
dequantize-then-slice, groups the split cuts become finer groups, or a dense shard (with one
warning) where those would be finer than MIN_SHARD_GROUP; each rank reads and holds about half of
the weights."""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.kernels.quantized import QuantWeight, pack_values
from pagedserve.kernels.reference import dequantize_weight
from pagedserve import LLM
from pagedserve.replicas.models.loader import checkpoint_tensors, load_config
from pagedserve.replicas.models import get_model_class
from pagedserve.replicas.models.layers import Linear, deferred_weights
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.parallel.sharding import (
    MIN_SHARD_GROUP, Shard, check_tensor_parallel, read_shard,
)
from tests import quant_checkpoints as qc
from tests.engine.tp_checks import assert_same_outputs, generate, random_prompts
from tests.tiny_models import build_tiny_family, build_tiny_model

PROMPT_LENS = [1, 3, 9, 17, 33]
MAX_TOKENS = [8, 5, 8, 10, 6]
ENGINE = dict(attention_backend="torch", num_threads=2, num_kv_blocks=64, dtype="float32")
SLOW = pytest.mark.slow  # each case starts a rank process (~5 s): the default suite keeps two
FORMATS = {
    "gguf-q4_1-tied": ("gguf", dict(weight_type="Q4_1", embedding_type="Q8_0")),
    "gptq-act-order": ("gptq", dict(bits=4, group_size=32, desc_act=True)),
    "gptq": ("gptq", dict(bits=4, group_size=32)),
    "awq": ("awq", dict(group_size=32)),
    "ct-w4a16": ("ct", dict(bits=4, strategy="group", group_size=32)),
}
CASES = ["gguf-q4_1-tied", "gptq-act-order", pytest.param("awq", marks=SLOW),
         pytest.param("ct-w4a16", marks=SLOW)]


def random_weight(n: int, k: int, bits: int, group_size: int, perm: torch.Tensor | None = None,
                  seed: int = 0) -> QuantWeight:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2 ** bits, (n, k), generator=generator, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=generator) + 0.1
    offsets = torch.randn(n, k // group_size, generator=generator)
    return QuantWeight(bits, group_size, pack_values(values, bits), scales, offsets, perm)


def split_groups_perm(k: int, group_size: int, split: int, seed: int = 0) -> torch.Tensor:
    """An act-order perm whose every stored group holds as many channels below `split` as above."""
    generator = torch.Generator().manual_seed(seed)
    low = torch.randperm(split, generator=generator)
    high = split + torch.randperm(k - split, generator=generator)
    half = group_size // 2
    return torch.cat([torch.cat((low[g * half:(g + 1) * half], high[g * half:(g + 1) * half]))
                      for g in range(k // group_size)])


# -- QuantWeight.columns and the shard of a QuantWeight ----------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("perm_kind", ["none", "random", "split_groups"])
@pytest.mark.parametrize("start,stop", [(0, 128), (128, 256), (64, 192), (96, 160), (0, 256),
                                        (5, 132)])
def test_columns_equal_dequantize_then_slice(bits, perm_kind, start, stop):
    k, group_size = 256, 32
    perm = {"none": None, "random": torch.randperm(k, generator=torch.Generator().manual_seed(1)),
            "split_groups": split_groups_perm(k, group_size, 128)}[perm_kind]
    weight = random_weight(24, k, bits, group_size, perm)
    part = weight.columns(start, stop)
    assert part.shape == (24, stop - start)
    assert torch.equal(dequantize_weight(part), dequantize_weight(weight)[:, start:stop])
    if perm_kind == "none" and start % group_size == 0 and stop % group_size == 0:
        assert (part.group_size, part.bits, part.perm) == (group_size, bits, None)
    if perm_kind == "split_groups" and (start, stop) in ((0, 128), (128, 256)):
        assert part.group_size == group_size // 2 and part.perm is not None  # halves of each group


def test_row_shards_concatenate_ranges_and_own_their_storage():
    weight = random_weight(96, 64, 4, 32)
    dense = dequantize_weight(weight)
    fused = read_shard(weight, Shard(0, ((0, 16), (48, 56), (80, 88))))  # a Phi-3 q|k|v part
    assert torch.equal(dequantize_weight(fused), torch.cat((dense[0:16], dense[48:56], dense[80:88])))
    single = read_shard(weight, Shard(0, ((32, 64),)))
    assert torch.equal(dequantize_weight(single), dense[32:64])
    assert single.q.untyped_storage().nbytes() == single.q.numel()  # not a view of the whole


def test_a_column_shard_that_cuts_groups_is_finer_groups_or_dense():
    weight = random_weight(8, 384, 4, 128)  # groups of 128 over 2 or 3 ranks' worth of columns
    dense = dequantize_weight(weight)
    finer = read_shard(weight, Shard(1, ((192, 384),)))  # pieces of 64 and 128: groups of 64
    assert isinstance(finer, QuantWeight) and finer.group_size == 64
    assert torch.equal(dequantize_weight(finer), dense[:, 192:384])
    cut = read_shard(weight, Shard(1, ((120, 248),)))  # pieces of 8 and 120: finer than 16
    assert 8 < MIN_SHARD_GROUP
    assert not isinstance(cut, QuantWeight) and torch.equal(cut, dense[:, 120:248])


# -- reading only a rank's part ---------------------------------------------------------------

SHARDS = [Shard(0, ((64, 128),)), Shard(0, ((0, 32), (96, 128))), Shard(1, ((128, 256),)),
          Shard(1, ((0, 128),))]
# format variant -> writer options, and whether its column shards are cut from the pieces (False:
# act-order, read whole and then cut)
READ_VARIANTS = {
    "gptq-g32": ("gptq", dict(bits=4, group_size=32), True),
    "gptq-channel": ("gptq", dict(bits=4, group_size=-1), True),
    "gptq-w8-act-order": ("gptq", dict(bits=8, group_size=32, desc_act=True), False),
    "awq-g64": ("awq", dict(group_size=64), True),
    "ct-w4-g32": ("ct", dict(bits=4, strategy="group", group_size=32), True),
    "ct-w4-channel-asym": ("ct", dict(bits=4, strategy="channel", group_size=None, symmetric=False), True),
    "ct-w8-naive": ("ct", dict(bits=8, strategy="channel", group_size=None, format="naive-quantized"), True),
}


def _value(x):
    return dequantize_weight(x) if isinstance(x, QuantWeight) else x.float()


@pytest.mark.parametrize("variant", list(READ_VARIANTS))
def test_safetensors_formats_read_a_shard_as_the_whole_weight_cut(variant, sources, tmp_path):
    kind, options, cut_from_pieces = READ_VARIANTS[variant]
    writer = {"gptq": qc.write_gptq, "awq": qc.write_awq, "ct": qc.write_compressed_tensors}[kind]
    writer(sources[False], tmp_path, **options)
    _, _, whole, _ = checkpoint_tensors(tmp_path)
    _, _, lazy, _ = checkpoint_tensors(tmp_path, lazy=True)
    whole = dict(whole)
    checked = 0
    for name, source in lazy:
        if not hasattr(source, "shard_pieces"):
            continue
        for shard in SHARDS:
            assert torch.equal(_value(read_shard(source, shard)), _value(read_shard(whole[name], shard)))
            read_part = source.shard_pieces(source.module, source.parts, shard) is not None
            assert read_part == (cut_from_pieces or shard.dim == 0), (name, shard)
        checked += 1
    assert checked == 14  # 7 projections in each of 2 layers


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q4_1", "F16"])
def test_gguf_reads_a_shard_as_the_whole_tensor_cut(kind, sources, tmp_path):
    path, _ = qc.write_gguf(sources[False], tmp_path / "model.gguf", kind)
    from pagedserve.replicas.quant import read_gguf
    gguf = read_gguf(path)
    names = {hf: name for name, hf in gguf.names.items()}
    # q_proj's rows are permuted back from llama.cpp's order; down_proj's 512 columns over ranges
    # that cut K-quants' 256-value super-blocks
    for hf, shard in [("model.layers.0.self_attn.q_proj.weight", Shard(0, ((64, 128), (192, 224)))),
                      ("model.layers.0.mlp.down_proj.weight", Shard(1, ((96, 352),))),
                      ("model.layers.1.mlp.down_proj.weight", Shard(1, ((256, 512),))),
                      ("model.embed_tokens.weight", Shard(0, ((0, 50),)))]:
        got = gguf.tensor(names[hf], shard)
        assert torch.equal(_value(got), _value(read_shard(gguf.tensor(names[hf]), shard))), hf


# -- loading one rank (no group needed) --------------------------------------------------------

@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-quant-src")
    common = dict(hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=2, seed=5)
    return {tied: build_tiny_model(root / f"tied-{tied}", "llama", tie_word_embeddings=tied, **common)
            for tied in (False, True)}


_written: dict[str, str] = {}


def checkpoint(fmt: str, sources, tmp_path_factory) -> str:
    if fmt not in _written:
        kind, options = FORMATS[fmt]
        out = tmp_path_factory.mktemp(fmt)
        if kind == "gguf":
            path, _ = qc.write_gguf(sources[fmt.endswith("-tied")], out / "model.gguf", **options)
        else:
            writer = {"gptq": qc.write_gptq, "awq": qc.write_awq, "ct": qc.write_compressed_tensors}[kind]
            writer(sources[False], out, **options)
            path = out
        _written[fmt] = str(path)
    return _written[fmt]


def load_rank(path: str, rank: int, world_size: int):
    """One rank's model, loaded as its process would (the group itself is not needed to load)."""
    hf_config, _, tensors, _ = checkpoint_tensors(Path(path), lazy=world_size > 1)
    tp = parallel_state.TensorParallel(rank, world_size)
    with parallel_state.building(tp), deferred_weights():
        model = get_model_class(hf_config)(hf_config, torch.float32, "torch")
    model.load_weights(tensors)
    return model


def held_bytes(model) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    for module in model.modules():
        for weight in ([module.quantized] if getattr(module, "quantized", None) is not None else []) + \
                (list(module.quant.parts.values()) if getattr(module, "quant", None) is not None else []):
            total += weight.nbytes
    return total


@pytest.mark.parametrize("fmt", ["gguf-q4_1-tied", "awq", "ct-w4a16"])
def test_each_rank_holds_about_half_of_a_quantized_checkpoint(fmt, sources, tmp_path_factory):
    path = checkpoint(fmt, sources, tmp_path_factory)
    full = held_bytes(load_rank(path, 0, 1))
    for rank in (0, 1):  # norms are replicated
        assert 0.45 < held_bytes(load_rank(path, rank, 2)) / full < 0.55


def test_act_order_row_parallel_shards_are_dense_with_one_warning(sources, tmp_path_factory, caplog):
    path = checkpoint("gptq-act-order", sources, tmp_path_factory)
    with caplog.at_level(logging.WARNING, logger="pagedserve.replicas.models.causal_lm"):
        model = load_rank(path, 1, 2)
    warnings = [r for r in caplog.records if "held dequantized" in r.getMessage()]
    assert len(warnings) == 1 and "o_proj" in warnings[0].getMessage()
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.quant is None and not layer.self_attn.o_proj.weight.is_meta
    assert layer.self_attn.qkv_proj.quant is not None  # column-parallel: quantized, perm whole


def test_quantized_families_that_do_not_shard_yet_say_so(tmp_path):
    # GPT-2's Conv1D weights are transposed on loading, which a quantized layout cannot follow
    config = load_config(build_tiny_family(tmp_path / "gpt2", "gpt2"))
    with pytest.raises(ValueError, match=r"not supported for quantized GPT2LMHeadModel checkpoints "
                                         r"yet \(got tensor_parallel_size=2\)"):
        check_tensor_parallel(config, 2, get_model_class(config), quantized=True)
    check_tensor_parallel(config, 2, get_model_class(config), quantized=False)  # its float shards
    for family in ("gemma2", "gemma3", "mixtral", "gpt_neox", "opt"):
        config = load_config(build_tiny_family(tmp_path / family, family))
        check_tensor_parallel(config, 2, get_model_class(config), quantized=True)
    llama = load_config(qc.build_quant_model(tmp_path / "llama"))
    check_tensor_parallel(llama, 2, get_model_class(llama), quantized=True)


# -- tensor_parallel_size=2 against 1 ----------------------------------------------------------

@pytest.mark.parametrize("fmt", CASES)
def test_tp2_matches_tp1_on_a_quantized_checkpoint(fmt, sources, tmp_path_factory):
    path = checkpoint(fmt, sources, tmp_path_factory)
    prompts = random_prompts(load_config(path).vocab_size, PROMPT_LENS)
    single = generate(LLM(path, **ENGINE), prompts, MAX_TOKENS)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        split = generate(llm, prompts, MAX_TOKENS)
    finally:
        llm.shutdown()
    assert_same_outputs(single, split)


# -- the other families, quantized -------------------------------------------------------------

# family -> the format written from its tiny checkpoint (tests/tiny_models.FAMILY_CONFIGS), each
# case a different path through the shards
FAMILY_CASES = [
    # every expert's w1 | w3 quantized apart (their own channel orders), w2's act-order column
    # shards held dense; the MoE runs each expert's quantized GEMM pair
    pytest.param("mixtral", "gptq-act-order"),
    pytest.param("gpt_neox", "awq", marks=SLOW),  # each rank's query_key_value rows reordered
    pytest.param("opt", "ct-w4a16", marks=SLOW),  # out_proj / fc2 biases added on rank 0 only
    pytest.param("gemma2", "gptq", marks=SLOW),
    pytest.param("gemma3", "awq", marks=SLOW),
]
TIE = 1e-3  # where transformers' own top two logits are this close, a quantized GEMM may differ
_families: dict[str, tuple[str, str, dict]] = {}


def family_checkpoint(family: str, fmt: str, tmp_path_factory) -> tuple[str, str, dict]:
    """(the family's quantized checkpoint, its float source, the float32 HF-named weights the
    quantized ones mean)."""
    key = f"{family}-{fmt}"
    if key not in _families:
        source = build_tiny_family(tmp_path_factory.mktemp(f"{family}-src"), family)
        kind, options = FORMATS[fmt]
        writer = {"gptq": qc.write_gptq, "awq": qc.write_awq, "ct": qc.write_compressed_tensors}[kind]
        out = tmp_path_factory.mktemp(key)
        _families[key] = (str(out), str(source), writer(source, out, **options))
    return _families[key]


def _reference(source: str, state: dict, prompts, out: Path) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens on the dequantized weights, and its top-2 gap at each. The
    weights go through a checkpoint: transformers renames (and stacks Mixtral's experts) on load."""
    from safetensors.torch import save_file
    shutil.copy(Path(source) / "config.json", out / "config.json")
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt, max_tokens in zip(prompts, MAX_TOKENS):
            ids = torch.tensor([prompt])
            generated = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_tokens, pad_token_id=0, output_scores=True,
                                    return_dict_in_generate=True)
            gaps = [float(s[0].topk(2).values.diff().abs()) for s in generated.scores]
            expected.append((generated.sequences[0, len(prompt):].tolist(), gaps))
    return expected


# The projections the writers leave dense: an untied lm_head, the MoE router, OPT's projections
# in and out.
DENSE_PROJECTIONS = re.compile(r"lm_head|\.mlp\.gate$|project_(in|out)")


def _num_quantized(model) -> tuple[int, int]:
    """(projections held quantized, projections the writers quantize)."""
    linears = [m for name, m in model.named_modules()
               if isinstance(m, Linear) and not DENSE_PROJECTIONS.search(name)]
    return sum(m.packed_quant is not None for m in linears), len(linears)


@pytest.mark.parametrize("family", ["mixtral", "gpt_neox", "gemma3"])  # OPT's position table is whole
def test_each_rank_holds_about_half_of_a_quantized_family(family, tmp_path_factory):
    path, _, _ = family_checkpoint(family, "awq", tmp_path_factory)
    full = held_bytes(load_rank(path, 0, 1))
    for rank in (0, 1):  # every expert's shard stays quantized
        assert 0.45 < held_bytes(load_rank(path, rank, 2)) / full < 0.55


@pytest.mark.parametrize("family,fmt", FAMILY_CASES)
def test_tp2_matches_tp1_on_a_quantized_family(family, fmt, tmp_path_factory):
    path, source, state = family_checkpoint(family, fmt, tmp_path_factory)
    prompts = random_prompts(load_config(path).vocab_size, PROMPT_LENS)
    llm = LLM(path, **ENGINE)
    single = generate(llm, prompts, MAX_TOKENS)
    quantized, total = _num_quantized(llm.llm_engine.runner.model)
    assert quantized == total  # each one kept quantized
    reference = _reference(source, state, prompts, tmp_path_factory.mktemp(f"{family}-{fmt}-ref"))
    for output, (tokens, gaps) in zip(single, reference):
        got = list(output.outputs[0].token_ids)
        for i, (a, b) in enumerate(zip(got, tokens)):
            if a != b:  # only where the reference itself nearly tied
                assert gaps[i] < TIE, f"token {i}: {a} vs {b}, reference top-2 gap {gaps[i]:.2e}"
                break
        else:
            assert got == tokens
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        split = generate(llm, prompts, MAX_TOKENS)
        rank0 = llm.llm_engine.runner.model
        # act-order's row-parallel shards are held dense (one warning); everything else quantized
        held, _ = _num_quantized(rank0)
        assert 0 < held <= quantized and (held == quantized or FORMATS[fmt][1].get("desc_act"))
    finally:
        llm.shutdown()
    assert_same_outputs(single, split)
