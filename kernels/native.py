"""Native CPU kernels: plain C in kernels/csrc, compiled on first use with the system C compiler
and called through ctypes.

One library per CPU level (kernels/cpu_features.py: "avx512_bf16", "avx512", "avx2", or "native"),
compiled with that level's flags; the process loads the one for cpu_level(), logged once when it
is built or found. A compiler that lacks a level's flags falls back to the level below, with a
warning. The packed GEMMs' wrappers are in kernels/native_linear.py.

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
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kernels import cpu_features

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
LIBRARY_NAME = "libpagedserve_cpu.so"
# No -ffast-math: the kernels match the torch references to float rounding; reductions vectorise
# through `omp simd reduction` instead.
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# Without an OpenMP runtime (Apple's clang) the kernels still build, single-threaded but vectorised.
FALLBACK_FLAGS = [f if f != "-fopenmp" else "-fopenmp-simd" for f in FLAGS]
SUPPORTED = {("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "x86_64"), ("darwin", "arm64")}

_STATUS = {  # the C kernels' status codes (csrc/common.h)
    1: (ValueError, "query_start_loc is not a non-decreasing list of offsets within the query rows"),
    2: (ValueError, "a decode sequence's seq_len is below 1 or beyond its block table"),
    3: (ValueError, "a block table entry used by a decode sequence is outside the KV cache"),
    4: (MemoryError, "out of memory for the attention scratch buffers"),
    5: (RuntimeError, "this build has no such kernel (the packed GEMM needs AVX2 and FMA, "
                      "the bf16 one AVX512-BF16)"),
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
        raise RuntimeError("the native CPU kernels are not available (see kernels.native.available)")
    if level not in _libraries:
        _libraries[level] = _load(_build_level(_compiler(), level)[1])
    return _libraries[level]


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    _declare(lib)
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
    """Build level with OpenMP, else without; raises the first CalledProcessError if neither does."""
    import fcntl  # POSIX only, like the platforms above: imported here so the module always imports

    sources = sorted(SOURCE_DIR.glob("*.[ch]"))
    failure = None
    for base in (FLAGS, FALLBACK_FLAGS):
        flags = [*base, *cpu_features.FLAGS[level]]
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


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "pagedserve_paged_decode_attention": [ptr, ptr, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64,
                                              i64, i64, i64, i64, f32, i64, f32, i32],
        "pagedserve_rms_norm": [ptr, ptr, ptr, i64, i64, f32, i32],
        "pagedserve_fused_add_rms_norm": [ptr, ptr, ptr, i64, i64, f32, i32],
        "pagedserve_silu_and_mul": [ptr, ptr, i64, i64, i32],
        "pagedserve_linear": [ptr, ptr, i64, ptr, ptr, i64, i64, i64, i32],
        "pagedserve_linear_panel": [],
        "pagedserve_linear_bf16": [ptr, ptr, i64, ptr, ptr, i32, i64, i64, i64, i32],
        "pagedserve_linear_bf16_panel": [],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int


def _library() -> ctypes.CDLL:
    if _lib is None and not available():
        raise RuntimeError("the native CPU kernels are not available (see kernels.native.available)")
    return _lib


# The wrappers run dozens of times per engine step: each checks its arguments with one boolean
# expression (each tensor attribute read costs ~0.1 us) and only explains a failure the slow way.

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


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype is not torch.int32 or not t.is_cpu or not t.is_contiguous() or t.shape != shape:
        raise ValueError(f"{name} must be a contiguous int32 CPU tensor of shape {list(shape)}, "
                         f"got {t.dtype} {list(t.shape)} on {t.device}")


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> None:
    """Decode attention into out, reading K/V in place through the block tables.

    query, out [num_tokens, num_heads, head_dim] (query's rows may be strided, as a view of a fused
    QKV projection); kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]; block_tables
    int32 [batch, width]; seq_lens int32 [batch]; query_start_loc int32 [batch + 1]. Only the rows
    of sequences with query_len 1 are written: the others (prefills) are left as they are.
    sliding_window and logits_soft_cap as in kernels/reference.py; block table entries wholly
    outside the window are never read (nor checked).
    """
    lib = _lib or _library()
    if not (_fits(out) and _fits(kv_cache) and query.dtype is _F32 and query.is_cpu):
        _explain(out=out, kv_cache=kv_cache, query=query.contiguous())
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("expected query [num_tokens, num_heads, head_dim] and kv_cache "
                         "[2, num_blocks, block_size, num_kv_heads, head_dim]")
    num_tokens, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} x {head_dim} do not fit KV heads "
                         f"{num_kv_heads} x {cache_head_dim}")
    if out.shape != query.shape:
        raise ValueError(f"out {list(out.shape)} must have query's shape {list(query.shape)}")
    if num_tokens and not query[0].is_contiguous():
        raise ValueError("each query row [num_heads, head_dim] must be contiguous")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    width = block_tables.shape[-1] if block_tables.dim() else -1
    _check_index("seq_lens", seq_lens, (batch,))
    _check_index("query_start_loc", query_start_loc, (batch + 1,))
    _check_index("block_tables", block_tables, (batch, width))
    _check(lib.pagedserve_paged_decode_attention(
        out.data_ptr(), query.data_ptr(), query.stride(0), kv_cache.data_ptr(), num_blocks, block_size,
        block_tables.data_ptr(), width, seq_lens.data_ptr(), query_start_loc.data_ptr(),
        batch, num_tokens, num_heads, num_kv_heads, head_dim, scale, sliding_window or 0,
        logits_soft_cap or 0.0, torch.get_num_threads()))


def _norm_rows(x: torch.Tensor, weight: torch.Tensor, other: torch.Tensor, other_name: str) -> int:
    """Rows of x after checking x, weight and other (out or residual, x's twin); raises otherwise."""
    if not (_fits(x) and _fits(weight) and _fits(other)):
        _explain(x=x, weight=weight, **{other_name: other})
    hidden = weight.shape[0] if weight.dim() == 1 else -1
    shape = x.shape
    if not shape or shape[-1] != hidden or other.shape != shape:
        raise ValueError(f"expected x and {other_name} [..., hidden] of one shape and weight "
                         f"[hidden], got {list(shape)}, {list(other.shape)} and {list(weight.shape)}")
    return x.numel() // hidden if hidden else 0


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out = x * rsqrt(mean(x^2, -1) + eps) * weight, over x's last dimension."""
    lib = _lib or _library()
    rows = _norm_rows(x, weight, out, "out")
    lib.pagedserve_rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows, weight.shape[0],
                            eps, torch.get_num_threads())


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight (vLLM's semantics)."""
    lib = _lib or _library()
    rows = _norm_rows(x, weight, residual, "residual")
    lib.pagedserve_fused_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), rows,
                                      weight.shape[0], eps, torch.get_num_threads())


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """x [..., 2 * I] = [gate | up] -> out [..., I] = silu(gate) * up."""
    lib = _lib or _library()
    if not (_fits(out) and _fits(x)):
        _explain(out=out, x=x)
    shape = out.shape
    if not shape or x.shape[:-1] != shape[:-1] or x.shape[-1] != 2 * shape[-1]:
        raise ValueError(f"x {list(x.shape)} must be out {list(shape)} with a last dimension twice as long")
    inter = shape[-1]
    lib.pagedserve_silu_and_mul(out.data_ptr(), x.data_ptr(), out.numel() // inter if inter else 0,
                                inter, torch.get_num_threads())
