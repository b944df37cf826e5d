"""The native kernels' build: one OpenMP runtime, the build cache (shared across processes, one
compile under concurrent builds), fallbacks for a broken compiler or one without a level's flags,
and the CPU level override."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagedserve.kernels import cpu_features, native

if not native.available():
    pytest.skip("native CPU kernels unavailable (no C compiler, or PAGEDSERVE_NATIVE=0)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_one_openmp_runtime():
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")
    # Loaded after torch, the library's libgomp.so.1 resolves to the runtime torch already loaded.
    # In a process of its own: other test modules import libraries with OpenMP runtimes of their
    # own (scikit-learn, through the embedding tests' reference), which the engine never loads.
    code = ("import json, torch\nfrom pagedserve.kernels import native\nassert native.available()\n"
            "print(json.dumps(sorted({l.split()[-1] for l in open('/proc/self/maps') "
            "if 'libgomp' in l or 'libiomp' in l})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    runtimes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runtimes) <= 1, runtimes


def _python(code: str, cache: Path) -> str:
    env = dict(os.environ, PAGEDSERVE_CACHE=str(cache))
    env.pop("PAGEDSERVE_NATIVE", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_build_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "a"))
    built = native._build(native._compiler())
    assert built.is_relative_to(tmp_path / "a")
    stamp = built.stat().st_mtime_ns
    # A fresh process finds that build and loads it without compiling.
    loaded = _python("import torch\nfrom pagedserve.kernels import native\n"
                     "native._compile = None  # calling it would fail\n"
                     "assert native.available()\nprint(native.library_path())", tmp_path / "a")
    assert Path(loaded) == built and built.stat().st_mtime_ns == stamp
    # Another cache directory gets its own build.
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "b"))
    other = native._build(native._compiler())
    assert other.is_relative_to(tmp_path / "b") and other.exists()


def test_concurrent_builds_compile_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    compile_once, calls = native._compile, []

    def counting_compile(*args):
        calls.append(args)
        compile_once(*args)

    monkeypatch.setattr(native, "_compile", counting_compile)
    paths = []
    builders = [threading.Thread(target=lambda: paths.append(native._build(native._compiler())))
                for _ in range(3)]
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    assert len(calls) == 1 and len(set(paths)) == 1 and len(paths) == 3


def test_failed_build_warns_and_falls_back(tmp_path, monkeypatch, caplog, restore_available):
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'this compiler is broken' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    assert not native.available()
    assert "this compiler is broken" in caplog.text


def test_compiler_without_a_level_falls_back_to_the_level_below(tmp_path, monkeypatch, caplog):
    compiler = tmp_path / "no-avx512-cc"
    compiler.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -mavx512f ] && '
                        '{ echo "unknown flag -mavx512f" >&2; exit 1; }; done\nexec cc "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    if cpu_features.detected_level() == "native":
        pytest.skip("not an x86 CPU with AVX2")
    level, path = native._build_level([str(compiler)], "avx512")
    assert level == "avx2" and path.parent.name.startswith("avx2-") and path.exists()
    assert "cannot build the avx512 kernels" in caplog.text


@pytest.mark.parametrize("forced, expected", [("", None), ("avx2", "avx2"), ("native", "native"),
                                              ("AVX2", "avx2"), ("sse9", None), ("avx1024", None)])
def test_level_override_only_lowers(monkeypatch, forced, expected):
    monkeypatch.setenv(cpu_features.OVERRIDE_ENV, forced)
    detected = cpu_features.detected_level()
    if expected and cpu_features.LEVELS.index(expected) > cpu_features.LEVELS.index(detected):
        pytest.skip(f"this CPU has only {detected}")
    cpu_features.cpu_level.cache_clear()
    try:
        assert cpu_features.cpu_level() == (expected or detected)
    finally:
        monkeypatch.undo()
        cpu_features.cpu_level.cache_clear()


def test_the_loaded_level_is_the_cpus():
    assert native.cpu_level() == cpu_features.cpu_level()
    assert native.library_path().parent.name.startswith(f"{native.cpu_level()}-")
