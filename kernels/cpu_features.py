"""The CPU level the native kernels are compiled for: one place that reads the CPU's features.

Levels, lowest first: "native" (no x86 SIMD level of ours: other architectures, or x86 without
AVX2 + FMA; compiled -march=native), "avx2" (AVX2 + FMA), "avx512" (AVX-512 F/BW/VL/DQ). Each
level's library is compiled with that level's flags only, so its build runs on any CPU that has
the level. PAGEDSERVE_CPU_LEVEL=avx2 (or native) forces a lower level; a higher one than the CPU
has is refused with a warning.
"""
from __future__ import annotations

import functools
import logging
import os
import platform

log = logging.getLogger(__name__)

LEVELS = ("native", "avx2", "avx512")
# What /proc/cpuinfo must list for each level, and the compiler flags that target it.
REQUIRED = {"avx2": {"avx2", "fma"}, "avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}
FLAGS = {
    "native": ["-march=native"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}
OVERRIDE_ENV = "PAGEDSERVE_CPU_LEVEL"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detected_level() -> str:
    """The highest level this CPU supports."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "native"
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo (macOS): torch's own dispatch probe
        import torch
        flags = {"avx512": REQUIRED["avx512"], "avx2": REQUIRED["avx2"]}.get(
            torch.backends.cpu.get_cpu_capability().lower(), set())
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
