"""python -m bench.fleet: the JSON it writes, and the PNG beside it."""
import json

from bench.fleet.__main__ import main

KEYS = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "output_tok_s", "hit_rate", "rejection_rate",
        "replica_seconds", "decision_us_p99"}


def test_the_command_writes_every_figure_per_router_and_a_plot(tmp_path):
    out = tmp_path / "run.json"
    main(["--replicas", "2", "--rate", "6", "--duration-s", "4", "--tenants", "3",
          "--num-blocks", "1500", "--num-stages", "2", "--output-tokens", "8",
          "--routers", "pagedserve,p2c,approx,random,oracle", "--seed", "3", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data["routers"]) == {"pagedserve", "p2c", "approx", "random", "oracle"}
    for result in data["routers"].values():
        assert KEYS <= set(result) and len(result["stages"]) == 2
    assert data["wall_s"] > 0 and data["ratios"]["p2c"][0]["rate"] == 3.0
    assert data["routers"]["oracle"]["hit_rate_of_oracle"] == 1.0
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_diurnal_autoscales_and_reports_the_ideal(tmp_path):
    out = tmp_path / "day.json"
    main(["--replicas", "1", "--rate", "8", "--duration-s", "20", "--tenants", "2",
          "--num-blocks", "1500", "--workload", "diurnal", "--routers", "pagedserve",
          "--output-tokens", "8", "--startup-s", "2", "--ideal-precision", "2", "--ideal-run-s", "10",
          "--out", str(out)])
    data = json.loads(out.read_text())
    ideal = data["ideal"]
    found = ideal["capacities"]
    assert [c["replicas"] for c in found] == list(range(1, len(found) + 1))
    for c in found[:-1]:  # bracketed to the precision asked for
        assert c["holds"] < c["fails"] <= c["holds"] + 2
    assert found[-1]["holds"] >= 8 or len(found) == 4  # held the peak, or hit --max-replicas
    assert data["ideal_replica_seconds"] == ideal["replica_seconds"] >= 20.0  # >= 1 a second
    assert ideal["replica_seconds_upper"] >= ideal["replica_seconds"]
    assert len(ideal["replicas_each_second"]) == 20
    assert sum(ideal["replicas_each_second"]) == ideal["replica_seconds"]
    assert ideal["foresight_replica_seconds"] >= ideal["replica_seconds"]
    r = data["routers"]["pagedserve"]
    assert r["replica_seconds"] >= 20.0
    assert r["replica_seconds_over_ideal"] == r["replica_seconds"] / ideal["replica_seconds"]
    assert r["longest_overload_s"] >= 0 and r["max_replicas_used"] >= 1


def test_routers_run_side_by_side_give_the_figures_of_runs_one_after_another(tmp_path):
    timings = {"wall_s", "cpu_s", "cpu_us_per_request", "decision_us_p50", "decision_us_p99"}
    runs = {}
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        main(["--replicas", "2", "--rate", "6", "--duration-s", "4", "--tenants", "3",
              "--num-blocks", "1500", "--num-stages", "2", "--output-tokens", "8",
              "--routers", "pagedserve,p2c,oracle", "--seed", "5", "--jobs", jobs,
              "--out", str(out)])
        routers = json.loads(out.read_text())["routers"]
        runs[jobs] = {name: {k: v for k, v in r.items() if k not in timings}
                      for name, r in routers.items()}
    assert list(runs["2"]) == ["pagedserve", "p2c", "oracle"]  # the order asked for
    assert runs["2"] == runs["1"]
