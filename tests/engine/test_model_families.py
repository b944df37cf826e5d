"""Every non-Llama family against transformers itself, through the engine: greedy tokens of one
mixed batch must match `generate` exactly in the default, chunked-prefill and forced-preemption
modes, and prompt logprobs must match a full forward. Each tiny config exercises its family's
quirks (tests/tiny_models.py: FAMILY_CONFIGS)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import transformers

from pagedserve.kernels import native_linear
from pagedserve import LLM, SamplingParams
from pagedserve.replicas.models import MODEL_REGISTRY, get_model_class
from tests.tiny_models import FAMILY_CONFIGS, build_tiny_family, hf_greedy

# Longer than Gemma's 8-token windows and than one 32-token chunk; within Phi-3's original
# context (64), which its max_model_len keeps it to (test_longrope.py: the other side).
PROMPT_LENS = [1, 3, 8, 9, 17, 24, 33, 40]
MAX_TOKENS = [12, 5, 10, 8, 12, 3, 10, 12]
MODES = {  # a small KV pool everywhere: allocating the default 1 GiB would cost more than the test
    "default": dict(num_kv_blocks=64),
    "chunked_32": dict(num_kv_blocks=64, max_num_batched_tokens=32),
    # 5 blocks of 16: the longest sequence (52 tokens) fits, the batch wants ~17
    "preempted": dict(num_kv_blocks=5, max_num_batched_tokens=32),
}
# Per family: longrope picks short_factor, as transformers does for these lengths, only if no
# longer sequence can be served.
ENGINE_ARGS = {"phi3": dict(max_model_len=64)}


@pytest.fixture(scope="module", params=list(FAMILY_CONFIGS))
def family(request, tmp_path_factory):
    path = build_tiny_family(tmp_path_factory.mktemp(request.param), request.param)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    vocab_size = hf_model.config.vocab_size
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    return SimpleNamespace(name=request.param, path=str(path), hf_model=hf_model, prompts=prompts,
                           expected=hf_greedy(hf_model, prompts, MAX_TOKENS))


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(family, mode):
    llm = LLM(family.path, attention_backend="torch", dtype="float32", **MODES[mode],
              **ENGINE_ARGS.get(family.name, {}))
    prompt_logprobs = 1 if mode == "default" else None
    params = [SamplingParams(temperature=0, max_tokens=m, prompt_logprobs=prompt_logprobs)
              for m in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in family.prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == family.expected
    if family.name == "mixtral" and native_linear.linear_available():  # experts on the grouped GEMM
        moe = [m for m in llm.llm_engine.runner.model.modules() if hasattr(m, "grouped")]
        assert moe and all(m.grouped is not None for m in moe)
    stats = llm.llm_engine.stats()
    if mode == "preempted":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if prompt_logprobs is None:
        return
    for prompt, output in zip(family.prompts, outputs):
        with torch.no_grad():
            ref = torch.log_softmax(family.hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for p in range(1, len(prompt)):
            got = output.prompt_logprobs[p][prompt[p]].logprob
            assert got == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4), (family.name, p)


def test_unsupported_architecture_names_it_and_the_supported_ones():
    config = SimpleNamespace(architectures=["GPTJForCausalLM"], model_type="gptj")
    with pytest.raises(ValueError, match=r"unsupported model architecture \['GPTJForCausalLM'\]") as error:
        get_model_class(config)
    for arch in ("GPT2LMHeadModel", "GPTNeoXForCausalLM", "OPTForCausalLM", "Qwen3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        assert arch in MODEL_REGISTRY and arch in str(error.value)


def test_checkpoints_without_the_head_prefix_load_the_same(tmp_path):
    """The original gpt2 checkpoint names its tensors as GPT2Model does (h.0..., no
    "transformer."), with causal-mask buffers beside them; both are accepted."""
    from safetensors.torch import load_file

    from pagedserve.replicas.models.loader import load_config

    path = build_tiny_family(tmp_path, "gpt2")
    weights = load_file(str(path / "model.safetensors"))
    bare = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    model_class = get_model_class(load_config(path))
    ours = model_class(load_config(path), attention_backend="reference")
    ours.load_weights(weights.items())
    theirs = model_class(load_config(path), attention_backend="reference")
    theirs.load_weights(bare.items())
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name
