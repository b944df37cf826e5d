"""The dashboards chart only metrics the code defines (names are defined once, in code)."""
import json
import re
from pathlib import Path

from pagedserve.serve_app.metrics import ALL_METRICS
from pagedserve.serve_app.routing.metrics import REPLICA_ROUTER_LOAD, ROUTING_DECISIONS

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "pagedserve.json"


def test_every_dashboard_series_is_a_defined_metric():
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count|total)$", "", m)
            for e in exprs for m in re.findall(r"ray_(pagedserve_\w+)", e)}
    defined = set(ALL_METRICS) | {ROUTING_DECISIONS, REPLICA_ROUTER_LOAD}
    assert used and used <= defined, used - defined
