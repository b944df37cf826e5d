"""Imported at start-up by the vLLM processes of a benchmark run with `--cpu-level` (see
bench/cpu_level.py): torch.cpu's hardware probes answer as a CPU of that level would, so that
vLLM-CPU loads the kernels it would load there."""
import os

# bench.cpu_level's OVERRIDE_ENV and CAPS levels, spelled out: this runs in vLLM's environment,
# where none of our packages can be imported.
_LEVEL = os.environ.get("PAGEDSERVE_CPU_LEVEL", "")
if _LEVEL in ("avx2", "avx512"):
    import torch.cpu

    def _no() -> bool:
        return False

    _ABSENT = ["_is_avx512_bf16_supported", "_is_avx512_vnni_supported", "_is_avx512_fp16_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"]
    if _LEVEL == "avx2":
        _ABSENT.append("_is_avx512_supported")
    for _probe in _ABSENT:
        if hasattr(torch.cpu, _probe):
            setattr(torch.cpu, _probe, _no)
