"""A GGUF file served as it is (`serve run serve_app:app model=/path/model.gguf`): the OpenAI API
answers with the offline engine's greedy text on the same file, the chat template and tokenizer
come from the GGUF metadata, and /v1/models names the file."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import deploy

APP_NAME = "gguf"
PREFIX = "/gguf"


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    from tests.quant_checkpoints import write_gguf
    from tests.tiny_models import build_tiny_model
    root = tmp_path_factory.mktemp("gguf-serving")
    source = build_tiny_model(root / "src", "llama", hidden_size=256, num_heads=4, num_kv_heads=2, seed=5)
    return str(write_gguf(source, root / "tiny.Q4_K.gguf", weight_type="Q4_K", embedding_type="Q8_0")[0])


@pytest.fixture(scope="module")
def gguf_app(cluster, gguf_model):
    from ray import serve
    deploy(dict(model=gguf_model, num_replicas=1, replica_num_cpus=0.5, num_threads=1,
                num_kv_blocks=64, max_model_len=256), APP_NAME, PREFIX)
    yield f"{cluster.base_url}{PREFIX}"
    serve.delete(APP_NAME)


def test_a_gguf_file_serves_the_offline_engines_greedy_text(gguf_app, gguf_model):
    from openai import OpenAI

    from pagedserve import LLM, SamplingParams

    client = OpenAI(base_url=f"{gguf_app}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [gguf_model]
    offline = LLM(gguf_model, num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = offline.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model=gguf_model, prompt="hello world", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=gguf_model, messages=messages, max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert chat.choices[0].message.content == want
    with httpx.Client(base_url=gguf_app, timeout=30) as http:
        tokens = http.post("/tokenize", json={"model": gguf_model, "prompt": "hello world"}).json()
    assert tokens["tokens"] == offline.get_tokenizer().encode("hello world")
