"""One engine replica over two tensor-parallel ranks under Ray Serve: the replica's placement
group has a bundle per rank, the OpenAI API answers what the offline single-rank engine answers,
and killing a rank's actor makes /health 503 until Serve has replaced the replica, after which
requests succeed again."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, deploy, wait_for

# The app starts two replicas of two ranks each (the first, then its replacement): about a minute.
slow = pytest.mark.slow

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def tp_app(cluster, tiny_model_dir):
    deploy(dict(model=tiny_model_dir, tensor_parallel_size=2, num_replicas=1, replica_num_cpus=0.5,
                health_check_period_s=1.0, **ENGINE_ARGS), "tp", "/tp")
    with httpx.Client(base_url=f"{cluster.base_url}/tp", timeout=60) as client:
        yield client
    from ray import serve
    serve.delete("tp")


def test_replica_options_reserve_a_bundle_per_rank():
    from pagedserve.serve_app.app import replica_options
    from pagedserve.serve_app.config import ServeSettings
    options = replica_options(ServeSettings.from_args(dict(tensor_parallel_size=2, num_threads=2)))
    assert options["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == 1.0  # the replica is rank 0, in bundle 0
    options = replica_options(ServeSettings.from_args(dict(
        tensor_parallel_size=2, replica_num_gpus=1, placement_group_strategy="PACK")))
    assert options["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert options["placement_group_strategy"] == "PACK"
    assert "placement_group_bundles" not in replica_options(ServeSettings.from_args({}))


def _complete(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/completions", json=dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                                    temperature=0))


def _rank_actors() -> list[dict]:
    import ray

    from pagedserve.replicas.deployment.rank_actors import RANK_ACTOR_PREFIX
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(RANK_ACTOR_PREFIX)]


@slow
def test_placement_group_has_a_bundle_per_rank(tp_app):
    import ray
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"
              and g["strategy"] == "STRICT_PACK" and len(g["bundles"]) == 2]
    assert groups, ray.util.placement_group_table()
    assert all(b == {"CPU": 0.25} for b in groups[0]["bundles"].values())
    assert len(_rank_actors()) == 1  # rank 1; rank 0 is the replica itself


@slow
def test_openai_api_answers_as_the_single_rank_engine(tp_app, offline_llm):
    """Streamed and whole, on the one token path: the replica's core (in a thread of the replica,
    where Ray placed the ranks) over its connection to the ingress."""
    import json

    from pagedserve import SamplingParams
    response = _complete(tp_app)
    assert response.status_code == 200, response.text
    expected = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8),
                                    use_tqdm=False)[0].outputs[0].text
    assert response.json()["choices"][0]["text"] == expected
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    with tp_app.stream("POST", "/v1/completions", json=body) as streamed:
        events = [line[len("data: "):] for line in streamed.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]
                   if json.loads(e)["choices"]) == expected


@slow
def test_a_dead_rank_fails_health_until_the_replica_is_replaced(tp_app):
    assert tp_app.get("/health").status_code == 200
    import ray
    (actor,) = _rank_actors()
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    wait_for(lambda: tp_app.get("/health").status_code == 503, 30, 0.2, "/health to report 503")
    wait_for(lambda: tp_app.get("/health").status_code == 200, 120, 0.5, "the replica's replacement")
    response = _complete(tp_app)
    assert response.status_code == 200, response.text
    assert len(_rank_actors()) == 1
