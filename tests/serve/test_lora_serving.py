"""LoRA adapters served for real: Ray Serve, HTTP and the `openai` SDK. Adapters given at start
(`lora_modules`) and loaded at run time (POST /v1/load_lora_adapter) are listed in /v1/models
under the base model, answer `model=<adapter>` with the offline engine's greedy tokens for that
adapter, never share KV blocks with another adapter, go to the replica that holds them, and are
refused clearly when bad; an unloaded one is 404."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import API_KEY, ENGINE_ARGS, MODEL_NAME, deploy, replica_stats

APP_NAME = "lora"
PREFIX = "/lora"
PROMPT = "the quick brown fox jumps over the lazy dog " * 3  # past two full blocks


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    from tests.lora_adapters import write_adapter
    root = tmp_path_factory.mktemp("lora-serving")
    return {name: str(write_adapter(tiny_model_dir, root / name, rank=rank, seed=seed))
            for name, rank, seed in (("static", 4, 1), ("alpha", 8, 2), ("beta", 16, 3),
                                     ("wide", 32, 4))}


@pytest.fixture(scope="module")
def lora_app(cluster, tiny_model_dir, adapters):
    from ray import serve
    deploy(dict(model=tiny_model_dir, num_replicas=2, replica_num_cpus=0.5, num_threads=1,
                api_keys=API_KEY, enable_lora=True, max_loras=2, max_lora_rank=16,
                lora_modules=[f"static={adapters['static']}"], allow_runtime_lora_updating=True,
                **ENGINE_ARGS), APP_NAME, PREFIX)
    yield f"{cluster.base_url}{PREFIX}"
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from pagedserve import LLM
    return LLM(tiny_model_dir, num_threads=1, enable_lora=True, max_loras=2, **ENGINE_ARGS)


def greedy_text(offline, adapters, name: str | None, prompt: str = PROMPT) -> str:
    from pagedserve import LoRARequest, SamplingParams
    lora = LoRARequest(name, 1 + list(adapters).index(name), adapters[name]) if name else None
    out = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False, lora_request=lora)
    return out[0].outputs[0].text


def test_adapters_load_answer_and_unload_through_the_openai_sdk(lora_app, adapters, offline):
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=f"{lora_app}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    http = httpx.Client(base_url=lora_app, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, "static"} and models["static"].parent == MODEL_NAME
    for name in ("alpha", "beta"):
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": adapters[name]})
        assert loaded.status_code == 200, loaded.text
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, "static", "alpha", "beta"}

    texts = {}
    for name in ("static", "alpha", "beta", None):
        texts[name] = client.completions.create(
            model=name or MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text
        assert texts[name] == greedy_text(offline, adapters, name), name
    assert len(set(texts.values())) == 4  # each adapter answers for itself
    from ray import serve
    handle = serve.get_app_handle(APP_NAME)  # another Ray job's door: the same names
    by_handle = handle.completions.remote({"model": "alpha", "prompt": PROMPT, "max_tokens": 8,
                                           "temperature": 0, "ignore_eos": True}).result()
    assert by_handle.model == "alpha" and by_handle.choices[0].text == texts["alpha"]
    chat = client.chat.completions.create(model="alpha", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hello"}])
    assert chat.model == "alpha" and chat.choices[0].message.content is not None

    # The same prompt under another adapter finds none of the first one's KV blocks.
    cached = []
    for name in ("beta", "beta", "alpha"):
        usage = client.completions.create(model=name, prompt="a prompt seen by beta first " * 4,
                                          max_tokens=1).usage
        cached.append(usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0)
    assert cached[1] > 0 and cached[2] == 0

    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(NotFoundError):
        client.completions.create(model="beta", prompt="hi", max_tokens=2)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 404
    static = http.post("/v1/unload_lora_adapter", json={"lora_name": "static"})
    assert static.status_code == 400 and "lora_modules" in static.json()["error"]["message"]

    # Bad adapters: 400 naming the field, nothing listed.
    bad = {"wide": "rank 32 is above max_lora_rank=16", "missing": "does not exist"}
    for name, message in bad.items():
        answer = http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                         "lora_path": adapters.get(name, "/nowhere")})
        assert answer.status_code == 400 and message in answer.json()["error"]["message"]
        assert answer.json()["error"]["param"] == "lora_path"
    with pytest.raises(BadRequestError):
        http_client = OpenAI(base_url=f"{lora_app}/v1", api_key=API_KEY, max_retries=0)
        http_client.post("/load_lora_adapter", body={"lora_name": "static", "lora_path": "/else"},
                         cast_to=str)
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, "static", "alpha"}
    no_key = httpx.post(f"{lora_app}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert no_key.status_code == 401


def test_an_adapters_requests_land_on_the_replica_that_holds_it(lora_app, adapters):
    from openai import OpenAI

    http = httpx.Client(base_url=lora_app, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "gamma",
                                                    "lora_path": adapters["beta"]}).status_code == 200
    client = OpenAI(base_url=f"{lora_app}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    for i in range(6):  # different prompts: no prefix pulls them anywhere
        client.completions.create(model="gamma", prompt=f"prompt number {i} " * (i + 1), max_tokens=2)
    holders = [replica for replica, stats in replica_stats(APP_NAME, 2).items()
               if "gamma" in stats.get("lora_resident", [])]
    assert len(holders) == 1, holders


def test_the_runtime_routes_are_off_unless_allowed(http):
    answer = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert answer.status_code == 404
