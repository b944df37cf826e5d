"""CPU binding (replicas/engine/cpu_binding.py): cpu_bind's spelling, claims that engine cores on one node
share without overlap and that free up when their holder dies, and serving processes that move
off the claimed CPUs and back."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedserve.replicas.engine import cpu_binding
from pagedserve.replicas.config import EngineConfig

pytestmark = pytest.mark.skipif(not cpu_binding.SUPPORTED, reason="Linux CPU affinity")


@pytest.fixture
def claims_path(tmp_path, monkeypatch):
    path = tmp_path / "cpus.json"
    monkeypatch.setattr(cpu_binding, "CLAIMS_PATH", path)
    return path


def allowed() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def test_cpu_lists_parse_as_taskset_writes_them():
    assert cpu_binding.parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert cpu_binding.parse_cpus("5, 2-2") == [2, 5]
    for bad in ("", "a", "3-1", "1-", "-1", "1,,2"):
        with pytest.raises(ValueError):
            cpu_binding.parse_cpus(bad)


def test_a_bad_cpu_bind_is_an_error_naming_the_setting():
    assert EngineConfig(cpu_bind="0-1").cpu_bind == "0-1"
    with pytest.raises(ValueError, match="cpu_bind"):
        EngineConfig(cpu_bind="all")
    with pytest.raises(ValueError, match="cpu_bind"):
        EngineConfig(cpu_bind="0", tensor_parallel_size=2)


def test_auto_claims_the_highest_free_cpus_and_a_list_claims_its_own(claims_path):
    cpus = allowed()
    assert cpu_binding.claim("auto", 1) == cpus[-1:]
    assert json.loads(claims_path.read_text())[str(os.getpid())]["cpus"] == cpus[-1:]
    assert cpu_binding.claim("auto", len(cpus) + 1) == []  # too few: unbound
    assert cpu_binding.claim("off", 1) == []
    assert cpu_binding.claim(str(cpus[0]), 1) == cpus[:1]
    with pytest.raises(ValueError, match="cpu_bind"):
        cpu_binding.claim(str(max(cpus) + 1), 1)
    cpu_binding.release()
    assert json.loads(claims_path.read_text()) == {}


def test_cores_on_one_node_claim_disjoint_cpus_and_a_dead_holders_come_free(claims_path):
    cpus = allowed()
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from pagedserve.replicas.engine import cpu_binding
        cpu_binding.CLAIMS_PATH = Path({str(claims_path)!r})
        print(cpu_binding.claim("auto", 1), flush=True)
        sys.stdin.read()  # hold the claim until the test lets go
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == str(cpus[-1:])
        assert cpu_binding.engine_cpus() == {cpus[-1]}
        assert cpu_binding.claim("auto", 1) == [cpus[-2]]  # the next free one, not the held one
        cpu_binding.release()
    finally:
        holder.kill()
        holder.wait()
    assert cpu_binding.engine_cpus() == set()  # its holder is gone
    assert cpu_binding.claim("auto", 1) == cpus[-1:]
    cpu_binding.release()


def test_a_serving_process_keeps_off_claimed_cpus_and_goes_back_once_they_are_free(claims_path):
    cpus = allowed()
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    # In a child: this process's affinity (every thread's, later ones included) must not change.
    script = textwrap.dedent(f"""
        import os, threading
        from pathlib import Path
        from pagedserve.replicas.engine import cpu_binding
        cpu_binding.CLAIMS_PATH = Path({str(claims_path)!r})
        seen = {{}}
        started = threading.Event()
        stop = threading.Event()
        def worker():
            started.set()
            stop.wait()
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        cpu_binding.claim("auto", 1)
        seen["kept_off"] = sorted(cpu_binding.keep_off_engine_cpus())
        seen["thread"] = sorted(os.sched_getaffinity(thread.native_id))
        cpu_binding.release()
        seen["back"] = sorted(cpu_binding.keep_off_engine_cpus())
        stop.set()
        thread.join()
        print(seen)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert ast.literal_eval(out) == {"kept_off": cpus[:-1], "thread": cpus[:-1], "back": cpus}


def test_reading_the_claims_leaves_an_unchanged_file_alone(claims_path):
    claims_path.write_text(' { } ')  # valid, and not how a write would spell it
    assert cpu_binding.engine_cpus() == set()
    assert claims_path.read_text() == ' { } '


def test_a_torn_claims_file_starts_over(claims_path):
    claims_path.write_text('{"12')
    assert cpu_binding.engine_cpus() == set()
    assert json.loads(claims_path.read_text()) == {}


def test_serving_processes_follow_cores_that_come_and_go_after_them(claims_path):
    """The engine replica's and the ingress's processes (both carry a core's traffic) keep off the
    CPUs of cores that claimed them later (a scale change) at each health check, and go back
    once those are free."""
    cpus = allowed()
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from pagedserve.replicas.engine import cpu_binding
        from pagedserve.replicas.deployment.engine_replica import EngineReplica
        from pagedserve.serve_app.ingress import Ingress
        cpu_binding.CLAIMS_PATH = Path({str(claims_path)!r})
        affinity = lambda: sorted(os.sched_getaffinity(0))

        class IdleCore:
            stats = {{}}
            def check_health(self):
                pass

        replica = object.__new__(EngineReplica)  # its state as __init__ leaves it, core aside
        replica.core, replica.stall_timeout_s = IdleCore(), 60.0
        replica._last_steps, replica._last_progress = -1, 0.0
        ingress = object.__new__(Ingress)
        seen = {{}}
        for name, process in (("replica", replica), ("ingress", ingress)):
            cpu_binding.claim("auto", 1)  # a core that came after this process started
            process.check_health()
            seen[name] = affinity()
            cpu_binding.release()
            process.check_health()
            seen[name + "_back"] = affinity()
        print(seen)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert ast.literal_eval(out.splitlines()[-1]) == {
        "replica": cpus[:-1], "replica_back": cpus, "ingress": cpus[:-1], "ingress_back": cpus}
