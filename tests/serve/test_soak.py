"""The soak benchmark's one-minute version passes: mixed load with cancellations and bad requests,
an engine replica killed half-way, every request ending cleanly, no leaked KV block, flat RSS."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serve.conftest import REPO

pytestmark = pytest.mark.long


def test_one_minute_soak_passes():
    run = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((REPO / "bench" / "results" / "soak.json").read_text())
    assert all(result["checks"].values()), result["checks"]
    assert result["requests"] > 100 and result["by_kind"]["cancel"] > 0
