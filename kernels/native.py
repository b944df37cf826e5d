"""Native CPU kernels: plain C in kernels/csrc, compiled on first use with the system C compiler
and called through the library's own Python entry points (csrc/python_entry.c) where this
interpreter's headers are installed, else through ctypes.

One library per CPU level (kernels/cpu_features.py: "avx512_bf16", "avx512", "avx2", or "native"),
compiled with that level's flags; the process loads the one for cpu_level(), logged once when it
is built or found. A compiler that lacks a level's flags falls back to the level below, with a
warning. The packed GEMMs' wrappers are in kernels/native_linear.py, the attention kernels' in
kernels/native_attention.py, the norms', rotary's and SiLU's in kernels/native_norm_act.py.

Each library is cached under $PAGEDSERVE_CACHE (default ~/.cache/pagedserve)/native/<level>-<key>/,
the key hashing the sources, the flags, the compiler's version and, for a -march=native build,
this CPU's feature flags (so a home directory shared by different machines does not share it).
Concurrent processes (Ray replicas, pytest workers) build once, under a file lock.

The library is loaded after torch (imported above), so its libgomp.so.1 dependency resolves, by
soname, to the copy torch has already loaded (torch/lib/libgomp.so.1): one OpenMP runtime and one
thread pool in the process, as /proc/self/maps shows (tests/kernels/test_native.py checks it).
Every call passes torch.get_num_threads(), so the kernels follow torch's thread setting.

PAGEDSERVE_NATIVE=0 turns the native path off; so does a missing compiler or a failed build
(one warning, then the torch code paths run).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from pagedserve.kernels import cpu_features

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
LIBRARY_NAME = "libpagedserve_cpu.so"
# No -ffast-math: the kernels match the torch references to float rounding; reductions vectorise
# through `omp simd reduction` instead.
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# Without an OpenMP runtime (Apple's clang) the kernels still build, single-threaded but vectorised.
FALLBACK_FLAGS = [f if f != "-fopenmp" else "-fopenmp-simd" for f in FLAGS]
# Flags that compile csrc/python_entry.c in (with this interpreter's headers, whose version is then
# part of the build key); a build without them is tried where they fail.
PYTHON_INCLUDE = Path(sysconfig.get_paths()["include"])
PYTHON_ENTRY_FLAGS = ["-DPS_PYTHON_ENTRY", f"-I{PYTHON_INCLUDE}"]
# "ctypes" calls every kernel through ctypes even where the library has its Python entry points.
CALLS_ENV = "PAGEDSERVE_NATIVE_CALLS"
SUPPORTED = {("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "x86_64"), ("darwin", "arm64")}

_STATUS = {  # the C kernels' status codes (csrc/common.h)
    1: (ValueError, "query_start_loc is not a non-decreasing list of offsets within the query rows"),
    2: (ValueError, "a sequence's seq_len is below 1 or its query length, or beyond its block table"),
    3: (ValueError, "a block table entry used by a sequence is outside the KV cache"),
    4: (MemoryError, "out of memory for the attention scratch buffers"),
    5: (RuntimeError, "this build has no such kernel (the packed GEMM needs AVX2 and FMA, "
                      "the bf16 one AVX512-BF16)"),
    6: (ValueError, "quantized weight layout the kernel cannot run: bits must be 4 or 8 and the "
                    "group size divide k (and be even for 4 bits)"),
    7: (ValueError, "group offsets must start at 0 and never decrease"),
    8: (ValueError, "a slot_mapping entry is outside the KV cache"),
    9: (ValueError, "a LoRA token_slots entry is neither -1 nor a slot, or a rank is outside [0, R]"),
}
_F32 = torch.float32

_lib: ctypes.CDLL | None = None  # the library for cpu_level()
_library_path: Path | None = None
_level: str | None = None
_libraries: dict[str, ctypes.CDLL] = {}  # by the level asked for, loaded by library()


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "native"


def library_path() -> Path | None:
    """The shared library this process loaded, if any."""
    return _library_path


def cpu_level() -> str | None:
    """The CPU level of the library this process loaded ("avx512", "avx2", "native"), if any."""
    return _level if available() else None


@functools.cache
def available() -> bool:
    """Whether the native kernels can run here; builds (or finds the cached build) on first call."""
    global _lib, _library_path, _level
    if os.environ.get("PAGEDSERVE_NATIVE", "1") == "0":
        return False
    compiler = _compiler()
    if (sys.platform, platform.machine()) not in SUPPORTED or compiler is None:
        return False
    try:
        level, path = _build_level(compiler, cpu_features.cpu_level())
        lib = _load(path)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native CPU kernels unavailable, using the torch paths: %s", exc)
        return False
    _lib, _library_path, _level = lib, path, level
    log.info("native CPU kernels: level %s (detected %s), %s", level, cpu_features.detected_level(), path)
    return True


def library(level: str) -> ctypes.CDLL:
    """The library compiled for level (or the level below it, if the compiler lacks the flags),
    for running one level's kernels beside another's (tests, benchmarks). Only call its kernels
    where the CPU has the level."""
    if not available():
        raise RuntimeError("the native CPU kernels are not available (see pagedserve.kernels.native.available)")
    if level not in _libraries:
        _libraries[level] = _load(_build_level(_compiler(), level)[1])
    return _libraries[level]


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    if os.environ.get(CALLS_ENV, "python") != "ctypes":
        _bind_entries(lib, path)
    return lib


def _compiler() -> list[str] | None:
    compiler = shlex.split(os.environ.get("CC") or "cc")
    return compiler if compiler and shutil.which(compiler[0]) else None


def _build_key(compiler: list[str], version: str, flags: list[str], sources: list[Path]) -> str:
    h = hashlib.sha256()
    # A -march=native build compiles for this CPU's features (platform.processor() where no flags).
    cpu = (" ".join(sorted(cpu_features.cpu_flags())) or platform.processor()) \
        if "-march=native" in flags else ""
    for part in (shlex.join(compiler), version, " ".join(flags), platform.machine(), cpu):
        h.update(part.encode() + b"\0")
    for source in sources:
        h.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _build(compiler: list[str], level: str | None = None) -> Path:
    """Path to the shared library for these sources, compiler and level (default: this CPU's),
    compiling it if needed."""
    return _build_level(compiler, level or cpu_features.cpu_level())[1]


def _build_level(compiler: list[str], level: str) -> tuple[str, Path]:
    """(the level built, its library): level, or the first level below it that compiles."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    failure = None
    for candidate in cpu_features.lower_levels(level):
        try:
            return candidate, _build_flags(compiler, version, candidate)
        except subprocess.CalledProcessError as exc:
            if failure is None and candidate != "native":
                log.warning("%s cannot build the %s kernels, trying the level below: %s",
                            shlex.join(compiler), candidate, (exc.stderr or "")[-500:])
            failure = failure or exc
    raise subprocess.SubprocessError(f"{shlex.join(failure.cmd)} failed:\n{(failure.stderr or '')[-2000:]}")


def _build_flags(compiler: list[str], version: str, level: str) -> Path:
    """Build level with OpenMP, else without, each with the Python entry points where the headers
    are, else without them; raises the first CalledProcessError if none builds."""
    import fcntl  # POSIX only, like the platforms above: imported here so the module always imports

    sources = sorted(SOURCE_DIR.glob("*.[ch]"))
    failure = None
    entries = [PYTHON_ENTRY_FLAGS, []] if (PYTHON_INCLUDE / "Python.h").exists() else [[]]
    for flags in ([*base, *entry, *cpu_features.FLAGS[level]] for base in (FLAGS, FALLBACK_FLAGS)
                  for entry in entries):
        path = cache_dir() / f"{level}-{_build_key(compiler, version, flags, sources)}" / LIBRARY_NAME
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building this very key
            if path.exists():
                return path
            try:
                _compile(compiler, flags, [s for s in sources if s.suffix == ".c"], path)
                return path
            except subprocess.CalledProcessError as exc:
                failure = failure or exc
    raise failure


def _compile(compiler: list[str], flags: list[str], sources: list[Path], path: Path) -> None:
    """Compile into a temporary file beside path, then rename it into place atomically."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, *map(str, sources), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_PTR, _I64, _F32C, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# Every entry point's arguments (csrc/api.h has the prototypes; csrc/python_entry.c's SIGNATURES
# must spell the same list, letter by letter: see _bind_entries).
_ATTENTION = [_PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
              _F32C, _I64, _F32C, _I32, _I32]
SIGNATURES = {
    "pagedserve_paged_decode_attention": _ATTENTION,
    "pagedserve_paged_prefill_attention": _ATTENTION,
    "pagedserve_argmax_rows": [_PTR, _PTR, _I64, _I64, _I64, _I32, _I32],
    "pagedserve_sample_rows": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32, _I32],
    "pagedserve_rms_norm": [_PTR, _PTR, _PTR, _I64, _I64, _F32C, _I32, _I32],
    "pagedserve_fused_add_rms_norm": [_PTR, _PTR, _PTR, _I64, _I64, _F32C, _I32, _I32],
    "pagedserve_silu_and_mul": [_PTR, _PTR, _I64, _I64, _I32, _I32],
    "pagedserve_rotary_store_kv": [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                   _I64, _I64, _I32, _I32],
    "pagedserve_linear": [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I32],
    "pagedserve_linear_panel": [],
    "pagedserve_grouped_linear": [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I32],
    "pagedserve_linear_bf16": [_PTR, _PTR, _I64, _PTR, _PTR, _I32, _I64, _I64, _I64, _I32],
    "pagedserve_linear_bf16_panel": [],
    "pagedserve_quant_linear": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I32, _I32, _I64, _I64, _I64,
                                _I64, _I32],
    "pagedserve_quant_linear_panel": [],
    "pagedserve_quant_linear_i8": [_PTR, _PTR, _I64, _PTR, _PTR, _I32, _PTR, _I32, _I64, _I64, _I64,
                                   _I64, _I32],
    "pagedserve_quant_linear_i8_panel": [],
    "pagedserve_decoder_layers": [_PTR] * 13 + [_F32C, _F32C, _I32],
    "pagedserve_lora_delta": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                              _I64, _I32, _I32],
}
_LETTERS = {_PTR: "p", _I64: "i", _I32: "i", _F32C: "f"}  # python_entry.c's argument letters


def signature_letters(name: str) -> str:
    """SIGNATURES[name] in csrc/python_entry.c's letters (p pointer, i integer, f float)."""
    return "".join(_LETTERS[a] for a in SIGNATURES[name])


def _declare(lib: ctypes.CDLL) -> None:
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int


def _bind_entries(lib: ctypes.CDLL, path: Path) -> None:
    """Puts the library's own Python entry points (csrc/python_entry.c, built in where Python's
    headers are) in place of its ctypes functions, under the same names: the wrappers call
    lib.<kernel>(...) either way, and these skip ctypes' per-argument conversion
    (bench/native_calls.py measures the difference)."""
    try:
        lib.PyInit_pagedserve_cpu
    except AttributeError:
        return  # built without Python's headers: ctypes it is
    try:
        spec = importlib.util.spec_from_file_location("pagedserve_cpu", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        log.warning("%s: its Python entry points do not import (%s): calling through ctypes", path, exc)
        return
    for name in SIGNATURES:
        if module.SIGNATURES.get(name) != signature_letters(name):
            log.warning("%s: %s's Python entry point takes %r, not %r: calling through ctypes", path,
                        name, module.SIGNATURES.get(name), signature_letters(name))
            return
    for name in SIGNATURES:
        setattr(lib, name, getattr(module, name))


def calls(lib: ctypes.CDLL | None = None) -> str:
    """How the wrappers call lib's kernels (default: the loaded library's): "python" (its own
    entry points) or "ctypes"."""
    lib = lib or _library()
    return "ctypes" if isinstance(lib.pagedserve_linear_panel, ctypes._CFuncPtr) else "python"


def _library() -> ctypes.CDLL:
    if _lib is None and not available():
        raise RuntimeError("the native CPU kernels are not available (see pagedserve.kernels.native.available)")
    return _lib


def _level_library(level: str | None) -> ctypes.CDLL:
    """The loaded library, or (tests, benchmarks) another level's: see library()."""
    return (_lib or _library()) if level is None else library(level)


# The wrappers run dozens of times per engine step: each checks its arguments with one boolean
# expression (every tensor attribute read costs time) and only explains a failure the slow way.

def _check(status: int) -> None:
    if status:
        error, message = _STATUS.get(status, (RuntimeError, f"native kernel failed with status {status}"))
        raise error(message)


def _fits(t: torch.Tensor) -> bool:
    return t.dtype is _F32 and t.is_cpu and t.is_contiguous()


def _explain(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype is not _F32 or not t.is_cpu:
            raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


# Bits of the norm / activation / attention kernels' `dtypes` argument (csrc/common.h): which
# operands are bf16, the others being fp32. Every kernel computes in fp32.
BF16_DATA, BF16_WEIGHT, BF16_KV = 1, 2, 4
_BF16 = torch.bfloat16
_DATA_DTYPES = (_F32, _BF16)


def _fits_data(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous()


def _explain_data(dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    """Raises for the first tensor that is not a contiguous CPU tensor of dtype (fp32 or bf16)."""
    if dtype not in _DATA_DTYPES:
        raise ValueError(f"expected float32 or bfloat16 tensors, got {dtype}")
    for name, t in tensors.items():
        if t.dtype is not dtype or not t.is_cpu:
            raise ValueError(f"{name} must be a {dtype} CPU tensor (like the others), got {t.dtype} "
                             f"on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
