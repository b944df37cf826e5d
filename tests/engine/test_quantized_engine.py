"""Quantized checkpoints in the engine, every format as it is on disk: greedy tokens equal
transformers running the same model on the dequantized float32 weights (they may differ only
where the reference's two top logits are within 1e-3), prompt logprobs agree within 1e-3, in the
default, chunked-prefill and preempted modes."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from tests import quant_checkpoints as qc
from tests.tiny_models import build_tiny_model

PROMPT_LENS = [1, 3, 8, 9, 17, 24, 33, 40]
MAX_TOKENS = [12, 5, 10, 8, 12, 3, 10, 12]
MODES = {
    "default": dict(num_kv_blocks=64),
    "chunked_32": dict(num_kv_blocks=64, max_num_batched_tokens=32),
    "preempted": dict(num_kv_blocks=5, max_num_batched_tokens=32),
}
# format -> how to write it (K-quants need rows of 256: the tiny model's hidden size is 256)
FORMATS = {
    **{f"gguf-{t.lower()}": ("gguf", dict(weight_type=t, embedding_type="Q8_0"))
       for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")},
    "gguf-q6_k-tied-embedding": ("gguf", dict(weight_type="Q4_K", embedding_type="Q6_K", tied=True)),
    "gptq-w4g32": ("gptq", dict(bits=4, group_size=32)),
    "gptq-w4g64-asym": ("gptq", dict(bits=4, group_size=64, sym=False)),
    "gptq-w4g128-act-order": ("gptq", dict(bits=4, group_size=128, desc_act=True)),
    "gptq-w4-channel": ("gptq", dict(bits=4, group_size=-1)),
    "gptq-w8g32": ("gptq", dict(bits=8, group_size=32)),
    "awq-w4g32": ("awq", dict(group_size=32)),
    "awq-w4g64": ("awq", dict(group_size=64)),
    "ct-w4a16-g32": ("ct", dict(bits=4, strategy="group", group_size=32)),
    "ct-w4a16-g64-asym": ("ct", dict(bits=4, strategy="group", group_size=64, symmetric=False)),
    "ct-w8a16-channel": ("ct", dict(bits=8, strategy="channel", group_size=None)),
}
# The batched, chunked and preempted modes for one format of each family.
ALL_MODES = {"gguf-q4_k", "gptq-w4g128-act-order", "awq-w4g32", "ct-w4a16-g32"}
CASES = [(f, m) for f in FORMATS for m in MODES if m == "default" or f in ALL_MODES]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-src")
    common = dict(hidden_size=256, num_heads=4, num_kv_heads=2, seed=11)
    return {tied: build_tiny_model(root / f"tied-{tied}", "llama", tie_word_embeddings=tied, **common)
            for tied in (False, True)}


def write(fmt: str, source, out):
    kind, options = FORMATS[fmt]
    options = dict(options)
    options.pop("tied", None)
    if kind == "gguf":
        return qc.write_gguf(source, out / "model.gguf", **options)
    writer = {"gptq": qc.write_gptq, "awq": qc.write_awq, "ct": qc.write_compressed_tensors}[kind]
    return out, writer(source, out, **options)


_built: dict[str, SimpleNamespace] = {}


@pytest.fixture
def quantized(request, sources, tmp_path_factory):
    """The format's checkpoint, and the reference's greedy tokens, top-2 gaps and prompt logprobs."""
    fmt = request.param
    if fmt in _built:
        return _built[fmt]
    source = sources[bool(FORMATS[fmt][1].get("tied"))]
    path, state = write(fmt, source, tmp_path_factory.mktemp(fmt))
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    hf.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    expected = []
    with torch.no_grad():
        for prompt, max_tokens in zip(prompts, MAX_TOKENS):
            tokens, gaps = qc.greedy_with_gaps(hf, prompt, max_tokens)
            logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            expected.append((tokens, gaps, logprobs))
    _built[fmt] = SimpleNamespace(path=str(path), prompts=prompts, expected=expected)
    return _built[fmt]


@pytest.mark.parametrize("quantized,mode", CASES, indirect=["quantized"],
                         ids=[f"{f}-{m}" for f, m in CASES])
def test_greedy_matches_the_dequantized_reference(quantized, mode):
    llm = LLM(quantized.path, attention_backend="torch", dtype="float32", **MODES[mode])
    prompt_logprobs = 1 if mode == "default" else None
    params = [SamplingParams(temperature=0, max_tokens=m, prompt_logprobs=prompt_logprobs)
              for m in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in quantized.prompts], params, use_tqdm=False)
    for prompt, output, (tokens, gaps, logprobs) in zip(quantized.prompts, outputs, quantized.expected):
        qc.assert_greedy_matches_up_to_ties(output.outputs[0].token_ids, tokens, gaps)
        if prompt_logprobs:
            for p in range(1, len(prompt)):
                got_logprob = output.prompt_logprobs[p][prompt[p]].logprob
                assert got_logprob == pytest.approx(logprobs[p - 1, prompt[p]].item(), abs=qc.TIE)
    stats = llm.llm_engine.stats()
    if mode == "preempted":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_quantization_setting_that_disagrees_with_the_checkpoint_is_refused(sources, tmp_path):
    path, _ = qc.write_gguf(sources[False], tmp_path / "m.gguf", weight_type="Q8_0")
    with pytest.raises(ValueError, match="quantization='gptq'.*quantized with 'gguf'"):
        LLM(str(path), quantization="gptq", num_kv_blocks=8)
    with pytest.raises(ValueError, match="quantization='awq'.*not quantized"):
        LLM(str(sources[False]), quantization="awq", num_kv_blocks=8)


def test_a_truncated_gguf_file_is_a_clear_error_at_load(sources, tmp_path):
    path, _ = qc.write_gguf(sources[False], tmp_path / "m.gguf", weight_type="Q4_K")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match="cut.gguf"):
        LLM(str(cut), num_kv_blocks=8)
