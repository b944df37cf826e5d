"""The CPU level the native kernels are compiled for: one place that reads the CPU's features.

Levels, lowest first: "native" (no x86 SIMD level of ours: other architectures, or x86 without
AVX2 + FMA; compiled -march=native), "avx2" (AVX2 + FMA), "avx512" (AVX-512 F/BW/VL/DQ),
"avx512_bf16" (that plus AVX512-BF16: bf16 dot products, so bf16 weights get their own GEMM).
Each level's library is compiled with that level's flags only, so its build runs on any CPU that
has the level. PAGEDSERVE_CPU_LEVEL=avx512 (or avx2, native) forces a lower level; a higher one
than the CPU has is refused with a warning.
"""
from __future__ import annotations

import functools
import logging
import os
import platform

log = logging.getLogger(__name__)

LEVELS = ("native", "avx2", "avx512", "avx512_bf16")
# What /proc/cpuinfo must list for each level, and the compiler flags that target it.
_AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
REQUIRED = {"avx2": {"avx2", "fma"}, "avx512": _AVX512, "avx512_bf16": _AVX512 | {"avx512_bf16"}}
_AVX512_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
FLAGS = {
    "native": ["-march=native"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": _AVX512_FLAGS,
    "avx512_bf16": [*_AVX512_FLAGS, "-mavx512bf16"],
}
# Flags reported with the level (bench JSON, engine stats): what decides which kernels run.
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16",
                  "amx_tile")
OVERRIDE_ENV = "PAGEDSERVE_CPU_LEVEL"


def _cpuinfo_field(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line that starts with one of keys (the first CPU's);
    None where there is no such line or file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where there is no such file."""
    return set((_cpuinfo_field("flags", "Features") or "").split())


def detected_level() -> str:
    """The highest level this CPU supports."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "native"
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo (macOS): torch's own dispatch probe
        import torch
        flags = set(REQUIRED.get(torch.backends.cpu.get_cpu_capability().lower(), set()))
    for level in reversed(LEVELS[1:]):
        if REQUIRED[level] <= flags:
            return level
    return "native"


@functools.cache
def cpu_level() -> str:
    """The detected level, lowered by PAGEDSERVE_CPU_LEVEL if set."""
    detected = detected_level()
    forced = os.environ.get(OVERRIDE_ENV, "").strip().lower()
    if not forced:
        return detected
    if forced not in LEVELS:
        log.warning("ignoring %s=%s: not one of %s", OVERRIDE_ENV, forced, ", ".join(LEVELS))
        return detected
    if LEVELS.index(forced) > LEVELS.index(detected):
        log.warning("ignoring %s=%s: this CPU only has %s", OVERRIDE_ENV, forced, detected)
        return detected
    return forced


def lower_levels(level: str) -> list[str]:
    """level and those below it on this architecture, highest first: the build's fallbacks."""
    if level == "native":
        return ["native"]
    return [lv for lv in reversed(LEVELS[:LEVELS.index(level) + 1])]


def has_native_bf16() -> bool:
    """Whether bf16 matmuls run natively at the CPU level in use (AVX512-BF16; AMX CPUs have it
    too): there bf16 weights halve the bytes a decode step streams, at a compute speed near fp32's;
    elsewhere bf16 is emulated and many times slower than fp32 (bench/cpu_ops.py measures it)."""
    return LEVELS.index(cpu_level()) >= LEVELS.index("avx512_bf16")


# The dtype `dtype="auto"` runs an unquantized checkpoint in on the CPU, per level, whatever dtype
# the checkpoint is stored in (as vLLM's CPU backend does): bf16 where it is faster end to end than
# fp32, which is only where the CPU multiplies bf16 natively (avx512_bf16); below that bf16 matmuls
# are emulated and far slower, so fp32 (bench.offline_throughput --dtype float32,bfloat16 compares
# them).
# bf16 is not token-exact with transformers' fp32; dtype="float32" is, and tests that compare
# against transformers pass it.
#
# Weight-only quantized checkpoints follow the same table: their kernel (csrc/gemm_q.c) multiplies
# bf16 activations on vdpbf16ps past decode's few rows (Q_PAIRS), which makes bf16 the faster
# choice there too (bench/quant_gemm.py --dtype bfloat16 measures it).
AUTO_DTYPE = {"native": "float32", "avx2": "float32", "avx512": "float32", "avx512_bf16": "bfloat16"}


def auto_dtype() -> str:
    """The dtype an unquantized checkpoint runs in under dtype="auto" at the level in use."""
    return AUTO_DTYPE[cpu_level()]


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), "" where there is none: torch's
    MKL is Intel's library and is tuned for Intel's CPUs, which some kernel choices hinge on."""
    return _cpuinfo_field("vendor_id") or ""


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform reports."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def describe() -> dict:
    """The CPU, the level in use and the flags that pick kernels, for stats and benchmark records."""
    flags = cpu_flags()
    return {"model": cpu_name(), "level": cpu_level(), "detected_level": detected_level(),
            "flags": [f for f in REPORTED_FLAGS if f in flags], "native_bf16": has_native_bf16(),
            "auto_dtype": auto_dtype()}
