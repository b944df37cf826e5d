"""Weight-only quantized GEMMs (kernels/quant_linear.py, csrc/gemm_q.c) against the dense native
GEMM (kernels/cpu_linear.py) on a whole decode step's projections of the default model.

    python -m bench.quant_gemm [--rows 1 4 16 64] [--threads 1 2] [--layers 30] [--rounds 7]
                               [--dtype float32|bfloat16]

Shapes are SmolLM2-135M's: per layer the fused q|k|v (960 x 576), o (576 x 576), fused gate|up
(3072 x 576) and down (576 x 1536), each layer with its own weights so they stream from memory as
in the model, plus the lm_head (49152 x 576). Configurations, timed in alternating rounds (fp32,
int4, int8, fp32, ...), medians reported:
    fp32  every projection on the fp32 packed-panel GEMM (the baseline; with `--dtype bfloat16`,
          bf16 rows on the bf16 one, named "bf16": the activations' dtype is the engine's `dtype`)
    int4  the layers int4 group 32 with offsets (GGUF Q4_1, as the model ships), lm_head int8 g32
    int8  everything int8 group 32
Writes bench/results/quant_gemm.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import write_result
from pagedserve.kernels import cpu_features, cpu_linear, quant_linear, reference
from pagedserve.kernels.quantized import QuantWeight, pack_values

HIDDEN, INTERMEDIATE, Q_SIZE, KV_SIZE, VOCAB = 576, 1536, 576, 192, 49152
LAYER_SHAPES = {"qkv": (Q_SIZE + 2 * KV_SIZE, HIDDEN), "o": (HIDDEN, Q_SIZE),
                "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
GROUP = 32


def random_quant(n: int, k: int, bits: int, gen: torch.Generator) -> QuantWeight:
    values = torch.randint(0, 2 ** bits, (n, k), generator=gen, dtype=torch.uint8)
    groups = k // GROUP
    return QuantWeight(bits, GROUP, pack_values(values, bits), torch.rand(n, groups, generator=gen) * 0.01,
                       torch.randn(n, groups, generator=gen) * 0.01)


def dense_name(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


def build(args) -> tuple[dict[str, list[tuple[str, int, object]]], dict[str, int]]:
    """config -> [(projection name, in_features, call(x))] for one step, every layer's own weights
    (the dense one's being the dequantized int4 ones: the same values); and the weight bytes each
    reads."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(name, shape) for _ in range(args.layers) for name, shape in LAYER_SHAPES.items()]
    shapes.append(("lm_head", (VOCAB, HIDDEN)))
    base = dense_name(args.dtype)
    configs = {base: [], "int4": [], "int8": []}
    nbytes = dict.fromkeys(configs, 0)
    for name, (n, k) in shapes:
        int8 = random_quant(n, k, 8, gen)
        int4 = int8 if name == "lm_head" else random_quant(n, k, 4, gen)
        weight = reference.dequantize_weight(int4).to(args.dtype)
        dense = cpu_linear.pack(weight)
        if dense is not None and dense.replaces_weight:
            weight = None
        configs[base].append((name, k, lambda x, w=weight, p=dense: cpu_linear.linear(x, w, p)))
        nbytes[base] += (dense.tensor if weight is None else weight).untyped_storage().nbytes()
        for config, quantized in (("int4", int4), ("int8", int8)):
            packed = quant_linear.pack(quantized)
            configs[config].append((name, k, lambda x, p=packed: quant_linear.linear(x, p)))
            nbytes[config] += packed.nbytes
    return configs, nbytes


def time_step(calls, inputs) -> tuple[dict[str, float], float]:
    """Wall seconds per projection kind for one pass over the step's calls, and the calling
    thread's CPU seconds for the pass (on one thread, what other processes' load leaves out)."""
    spent: dict[str, float] = {}
    cpu = time.thread_time()
    for name, k, call in calls:
        start = time.perf_counter()
        call(inputs[k])
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    return spent, time.thread_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the activations' dtype (bf16 rows take the kernels' bf16 paths)")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    base = dense_name(args.dtype)
    if not quant_linear.available():
        print("note: no native quantized kernel here; int4/int8 run dequantized (kind 'dense')")
    configs, nbytes = build(args)
    cpu = cpu_features.describe()
    print(f"CPU: {cpu['model']} (level {cpu['level']}, flags {' '.join(cpu['flags'])}); "
          f"load average {os.getloadavg()[0]:.2f}")
    print("weight bytes per step: " + ", ".join(f"{c} {b / 2**20:.0f} MiB" for c, b in nbytes.items())
          + f" ({base} / int4 = {nbytes[base] / nbytes['int4']:.2f})")
    results = []
    print(f"{'threads':>7} {'rows':>5} {base + ' ms':>9} {'int4 ms':>9} {'int8 ms':>9} "
          f"{base + '/int4':>9} {base + '/int8':>9} {'cpu d/i4':>9} {'cpu d/i8':>9}  int4 per projection (ms: qkv o gate_up down lm_head)")
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                inputs = {k: torch.randn(rows, k).to(args.dtype) for k in (HIDDEN, INTERMEDIATE)}
                samples = {c: [] for c in configs}
                cpu_samples = {c: [] for c in configs}
                parts = {c: [] for c in configs}
                for c in configs:  # warm-up
                    time_step(configs[c], inputs)
                for _ in range(args.rounds):
                    for c, calls in configs.items():
                        spent, cpu_s = time_step(calls, inputs)
                        samples[c].append(sum(spent.values()))
                        cpu_samples[c].append(cpu_s)
                        parts[c].append(spent)
                med = {c: statistics.median(s) for c, s in samples.items()}
                cpu_med = {c: statistics.median(s) for c, s in cpu_samples.items()}
                per = {c: {name: statistics.median(p[name] for p in parts[c]) for name in parts[c][0]}
                       for c in configs}
                record = dict(threads=threads, rows=rows, **{f"{c}_ms": med[c] * 1e3 for c in configs},
                              **{f"{base}_over_int4": med[base] / med["int4"],
                                 f"{base}_over_int8": med[base] / med["int8"]},
                              cpu_ms={c: v * 1e3 for c, v in cpu_med.items()} if threads == 1 else None,
                              per_projection_ms={c: {k: v * 1e3 for k, v in per[c].items()} for c in configs},
                              load_average=os.getloadavg()[0])
                results.append(record)
                print(f"{threads:7d} {rows:5d} {med[base] * 1e3:9.2f} {med['int4'] * 1e3:9.2f} "
                      f"{med['int8'] * 1e3:9.2f} {record[base + '_over_int4']:9.2f} "
                      f"{record[base + '_over_int8']:9.2f} "
                      + (f"{cpu_med[base] / cpu_med['int4']:9.2f} {cpu_med[base] / cpu_med['int8']:9.2f}  "
                         if threads == 1 else f"{'-':>9} {'-':>9}  ")
                      + " ".join(f"{v * 1e3:.2f}" for v in per["int4"].values()), flush=True)
    finally:
        torch.set_num_threads(before)
    path = write_result("quant_gemm", dict(layers=args.layers, group_size=GROUP, rounds=args.rounds,
                                           dtype=str(args.dtype).removeprefix("torch."),
                                           weight_bytes=nbytes,
                                           load_average_end=os.getloadavg()[0], results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
