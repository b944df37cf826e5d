"""How long one continuous-batching step takes: a fixed overhead, plus a cost per prefill token,
plus a cost per decoding sequence. Fitted to measured steps by least squares (`fit`), saved and
loaded as JSON; `GPU_PROFILES` hold figures derived from published hardware specifications.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class CostModel:
    step_overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    name: str = "custom"

    def step_time(self, num_prefill_tokens: int, num_decode_seqs: int) -> float:
        return (self.step_overhead_s + num_prefill_tokens * self.prefill_token_s
                + num_decode_seqs * self.decode_seq_s)

    def to_json(self, path: str | Path, **extra) -> None:
        Path(path).write_text(json.dumps({**asdict(self), **extra}, indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        return cls(float(data["step_overhead_s"]), float(data["prefill_token_s"]),
                   float(data["decode_seq_s"]), data.get("name", Path(path).stem))


def _gpu_profile(name: str, hbm_bytes_per_s: float, dense_bf16_flops: float) -> CostModel:
    """Llama-3.1-8B in bf16 (16 GB of weights, 2 x 8e9 FLOPs per token; KV 128 KiB per token:
    32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes) at 50 % of peak FLOP/s in prefill and 70 %
    of peak bandwidth in decode (typical of vLLM / SGLang on Hopper). A decode step reads every
    weight once (the overhead) and each sequence's KV cache (per sequence, at the ~7k-token
    contexts of the llm-d workload)."""
    bandwidth = 0.7 * hbm_bytes_per_s
    return CostModel(step_overhead_s=16e9 / bandwidth,
                     prefill_token_s=16e9 / (0.5 * dense_bf16_flops),
                     decode_seq_s=7000 * 131072 / bandwidth, name=name)


# Published figures: NVIDIA H100 SXM datasheet (3.35 TB/s HBM3, 989 TFLOP/s dense BF16) and
# NVIDIA H200 datasheet (4.8 TB/s HBM3e, 141 GB, the same 989 TFLOP/s dense BF16).
GPU_PROFILES = {
    "h100": _gpu_profile("h100", 3.35e12, 989e12),
    "h200": _gpu_profile("h200", 4.8e12, 989e12),
}


def fit(samples: list[tuple[int, int, float]], name: str = "fitted") -> CostModel:
    """Least squares over (num_prefill_tokens, num_decode_seqs, seconds) samples, coefficients
    clamped at zero (a negative cost is noise). Needs samples that vary both counts."""
    if len(samples) < 3:
        raise ValueError("need at least 3 samples to fit 3 coefficients")
    # Normal equations A^T A x = A^T y for rows (1, p, d), solved by Gaussian elimination.
    rows = [(1.0, float(p), float(d)) for p, d, _ in samples]
    ys = [float(t) for _, _, t in samples]
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]
    coef = _solve(ata, aty)
    return CostModel(max(coef[0], 0.0), max(coef[1], 0.0), max(coef[2], 0.0), name)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("samples do not determine the model: vary prefill and decode counts")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def load(spec: str) -> CostModel:
    """A GPU profile's name, or the path of a JSON written by the calibration command."""
    if spec in GPU_PROFILES:
        return GPU_PROFILES[spec]
    return CostModel.from_json(spec)
