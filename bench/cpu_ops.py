"""Native CPU ops other than attention, each against what it replaces, timed in the same run:
RMSNorm / fused add + RMSNorm / SiLU-and-mul vs their torch references, the fused rotary + KV
store vs the torch calls it replaced (64-wide heads, a third of them KV heads), and a whole step's
projections on the native packed-panel GEMM (AVX2, and AVX-512 where the CPU has it) vs MKL
(torch's F.linear) vs oneDNN on prepacked weights; with bf16 weights, the native bf16 GEMM's
tiles vs torch's bf16 F.linear and oneDNN; the random sampler's native draw vs the exponential
race it replaced. Part of `python -m bench.kernels --cpu`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import max_error, time_interleaved
from pagedserve.kernels import (
    cpu_features,
    native,
    native_linear,
    native_norm_act,
    norm_act,
    rotary,
    torch_attention,
)


def run_norm_act(args) -> list[dict]:
    """Native RMSNorm, fused add + RMSNorm and SiLU-and-mul against the torch formulas they replace."""
    hidden, inter, eps = args.hidden, args.intermediate, 1e-5
    print(f"\nfloat32 norm/act, hidden {hidden}, intermediate {inter}, {args.threads} thread(s); "
          f"times in us; x torch = torch / native")
    print(f"{'op':38} {'torch':>10} {'native':>9} {'x torch':>7} {'err':>8}")
    rms, silu_and_mul = norm_act.rms_norm_reference, norm_act.silu_and_mul_reference

    rows = []
    for tokens in (1, 64, 1024):
        x, weight, residual = torch.randn(tokens, hidden), torch.randn(hidden), torch.randn(tokens, hidden)
        gate_up = torch.randn(tokens, 2 * inter)
        out, act = torch.empty_like(x), torch.empty(tokens, inter)
        # The fused op works in place: on copies, so x and residual stay the torch formula's inputs.
        x2, residual2 = x.clone(), residual.clone()
        native_norm_act.fused_add_rms_norm(x2, residual2, weight, eps)
        native_norm_act.rms_norm(out, x, weight, eps)
        native_norm_act.silu_and_mul(act, gate_up)
        cases = {
            "rms_norm": (lambda: rms(x, weight, eps), lambda: native_norm_act.rms_norm(out, x, weight, eps),
                         max_error(out, rms(x, weight, eps))),
            "fused_add_rms_norm": (lambda: rms(x + residual, weight, eps),
                                   lambda: native_norm_act.fused_add_rms_norm(x2, residual2, weight, eps),
                                   max_error(x2, rms(x + residual, weight, eps))),
            "silu_and_mul": (lambda: silu_and_mul(gate_up), lambda: native_norm_act.silu_and_mul(act, gate_up),
                             max_error(act, silu_and_mul(gate_up))),
        }
        cases["rotary_store_kv"] = _rotary_case(tokens, hidden)
        for op, (torch_fn, native_fn, err) in cases.items():
            t = time_interleaved({"torch": torch_fn, "native": native_fn}, min_time_s=args.min_time)
            name = f"{op} {tokens} tokens"
            rows.append(dict(kind="norm_act", case=name, dtype="float32", torch_us=t["torch"] * 1e6,
                             native_us=t["native"] * 1e6, speedup_vs_torch=t["torch"] / t["native"],
                             max_error=err))
            print(f"{name:38} {t['torch'] * 1e6:10.1f} {t['native'] * 1e6:9.1f} "
                  f"{t['torch'] / t['native']:7.2f} {err:8.1e}", flush=True)
    return rows


def _rotary_case(tokens: int, hidden: int, head_dim: int = 64):
    heads = max(1, hidden // head_dim)
    kv_heads = max(1, heads // 3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    cos, sin = torch.randn(tokens, 1, head_dim).chunk(2, dim=-1)
    cache = torch.zeros(2, (tokens + 15) // 16, 16, kv_heads, head_dim)
    slots = torch.arange(tokens)
    args = (cos, sin, cache, slots, heads, kv_heads, head_dim)
    want = rotary.rotary_store_kv_reference(qkv, *args)
    got = qkv.clone()
    native_norm_act.rotary_store_kv(got, *args)
    err = max_error(rotary.split_qkv(got, heads, kv_heads, head_dim)[0], want)
    return (lambda: rotary.rotary_store_kv_reference(qkv, *args, store_kv=torch_attention.store_kv),
            lambda: native_norm_act.rotary_store_kv(got, *args), err)


def run_linear(args) -> list[dict]:
    """A whole step's projections (every layer's q/k/v, o, gate/up, down with its own weights, so
    they stream from memory as in the model, plus lm_head): MKL's F.linear, oneDNN on prepacked
    weights, and the native packed-panel GEMM of every CPU level this CPU runs (AVX2, AVX-512),
    at decode-to-prefill row counts. The ratios are for the level the engine loads."""
    q_size = args.heads * args.head_dim
    shapes = [(q_size + 2 * args.kv_heads * args.head_dim, args.hidden), (args.hidden, q_size),
              (2 * args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    weights = [torch.randn(n, k) for _ in range(args.layers) for n, k in shapes]
    weights.append(torch.randn(args.vocab, args.hidden))
    contenders = {"mkl": lambda x, w, p: F.linear(x, w),
                  "onednn": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p["onednn"], None,
                                                                              "none", [], "")}
    packs = [{"onednn": torch.ops.mkldnn._reorder_linear_weight(w, 64)} for w in weights]
    levels = []
    if native_linear.linear_available():
        detected = cpu_features.LEVELS.index(cpu_features.detected_level())
        levels = [lv for lv in ("avx2", "avx512") if cpu_features.LEVELS.index(lv) <= detected]
    for level in levels:
        name = f"native_{level}"
        contenders[name] = lambda x, w, p, name=name: native_linear.linear(x, p[name], w.shape[0])
        for w, p in zip(weights, packs):
            p[name] = native_linear.pack_linear_weight(w, level)
    # avx512_bf16's fp32 tile is avx512's.
    best = f"native_{levels[-1]}" if levels else None
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"\nfloat32 projections of one step ({args.layers} layers + lm_head, "
          f"{flops_per_row / 2e6:.0f}M weights), {args.threads} thread(s), {cpu_features.cpu_name()}, "
          f"native level {native.cpu_level()}; ms per step and GFLOP/s; ratios for {best}")
    ratios = ["x mkl", "x onednn"] + (["x avx2"] if "native_avx512" in contenders else [])
    print(f"{'rows':>6} " + " ".join(f"{name:>17}" for name in contenders)
          + "".join(f" {r:>8}" for r in ratios))
    rows = []
    for count in [1, 4, 16, 64, 256] + ([] if args.quick else [1024]):
        xs = {k: torch.randn(count, k) for k in {w.shape[1] for w in weights}}

        def step(fn):
            return lambda: [fn(xs[w.shape[1]], w, p) for w, p in zip(weights, packs)]

        t = time_interleaved({name: step(fn) for name, fn in contenders.items()}, min_time_s=args.min_time,
                             max_rounds=5)
        row = dict(kind="linear", case=f"{count} rows", dtype="float32", cpu=cpu_features.cpu_name(),
                   native_level=native.cpu_level(), **{f"{name}_ms": s * 1e3 for name, s in t.items()},
                   **{f"{name}_gflops": count * flops_per_row / s / 1e9 for name, s in t.items()})
        speedups = []
        if best:
            row.update(native_speedup_vs_mkl=t["mkl"] / t[best],
                       native_speedup_vs_onednn=t["onednn"] / t[best])
            speedups = [row["native_speedup_vs_mkl"], row["native_speedup_vs_onednn"]]
        if "native_avx512" in t:
            row["avx512_speedup_vs_avx2"] = t["native_avx2"] / t["native_avx512"]
            speedups.append(row["avx512_speedup_vs_avx2"])
        rows.append(row)
        print(f"{count:6d} " + " ".join(f"{t[n] * 1e3:8.1f} {row[n + '_gflops']:5.0f} GF/s" for n in t)
              + "".join(f" {r:8.2f}" for r in speedups), flush=True)
    return rows


def run_linear_bf16(args) -> list[dict]:
    """The same step's projections with bf16 weights and activations: torch's bf16 F.linear and
    oneDNN on prepacked weights (what torch does without us) against the native bf16 GEMM's two
    tiles (vdpbf16ps "dot", fp32-FMA "widen"), with the native fp32 GEMM on fp32 copies for scale.
    The ratios are for the tile native_linear.bf16_tile() picks, the one the engine runs."""
    if not native_linear.linear_bf16_available():
        print(f"\nbf16 projections: skipped, CPU level {native.cpu_level()} has no AVX512-BF16 GEMM")
        return []
    q_size = args.heads * args.head_dim
    shapes = [(q_size + 2 * args.kv_heads * args.head_dim, args.hidden), (args.hidden, q_size),
              (2 * args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    weights = [torch.randn(n, k).bfloat16() for _ in range(args.layers) for n, k in shapes]
    weights.append(torch.randn(args.vocab, args.hidden).bfloat16())
    packs = [{"onednn": torch.ops.mkldnn._reorder_linear_weight(w, 64),
              "native": native_linear.pack_linear_weight_bf16(w),
              "fp32": native_linear.pack_linear_weight(w.float())} for w in weights]
    contenders = {
        "torch_bf16": lambda x, w, p: F.linear(x, w),
        "onednn_bf16": lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p["onednn"], None, "none", [], ""),
        "native_dot": lambda x, w, p: native_linear.linear_bf16(x, p["native"], w.shape[0]),
        "native_widen": lambda x, w, p: native_linear.linear_bf16(x, p["native"], w.shape[0], widen=True),
        "native_fp32": lambda x, w, p: native_linear.linear(x.float(), p["fp32"], w.shape[0]),
    }
    chosen = f"native_{native_linear.bf16_tile()}"
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"\nbf16 projections of one step ({args.layers} layers + lm_head), {args.threads} thread(s), "
          f"{cpu_features.cpu_name()}, level {native.cpu_level()}, tile picked: {chosen}; ms per step and GFLOP/s")
    print(f"{'rows':>6} " + " ".join(f"{name:>17}" for name in contenders)
          + f" {'x torch':>8} {'x onednn':>8} {'x fp32':>8}")
    rows = []
    for count in [1, 4, 16, 64, 256] + ([] if args.quick else [1024]):
        xs = {k: torch.randn(count, k).bfloat16() for k in {w.shape[1] for w in weights}}
        err = max(max_error(native_linear.linear_bf16(xs[w.shape[1]], p["native"], w.shape[0], widen=widen),
                            F.linear(xs[w.shape[1]], w)) for w, p in zip(weights[:4], packs) for widen in (0, 1))

        def step(fn):
            return lambda: [fn(xs[w.shape[1]], w, p) for w, p in zip(weights, packs)]

        t = time_interleaved({name: step(fn) for name, fn in contenders.items()}, min_time_s=args.min_time,
                             max_rounds=5)
        row = dict(kind="linear_bf16", case=f"{count} rows", dtype="bfloat16", cpu=cpu_features.cpu_name(),
                   native_level=native.cpu_level(), bf16_tile=chosen, max_error=err,
                   **{f"{name}_ms": s * 1e3 for name, s in t.items()},
                   **{f"{name}_gflops": count * flops_per_row / s / 1e9 for name, s in t.items()},
                   native_bf16_speedup_vs_torch=t["torch_bf16"] / t[chosen],
                   native_bf16_speedup_vs_onednn=t["onednn_bf16"] / t[chosen],
                   native_bf16_speedup_vs_fp32=t["native_fp32"] / t[chosen],
                   fastest=min(t, key=t.get))
        rows.append(row)
        print(f"{count:6d} " + " ".join(f"{t[n] * 1e3:8.1f} {row[n + '_gflops']:5.0f} GF/s" for n in t)
              + f" {row['native_bf16_speedup_vs_torch']:8.2f} {row['native_bf16_speedup_vs_onednn']:8.2f}"
              f" {row['native_bf16_speedup_vs_fp32']:8.2f}", flush=True)
    return rows


def _exponential_race(logits: torch.Tensor) -> torch.Tensor:
    """The random draw the native one replaced: argmax of probs / q, q = -log U per entry."""
    probs = logits.float().softmax(dim=-1)
    q = torch.empty_like(probs).uniform_()
    return probs.div_(q.log_().neg_()).argmax(dim=-1)


def run_sample(args) -> list[dict]:
    """The random sampler's draw (csrc/sample.c, inverse CDF at one uniform per row) against the
    exponential race it replaced and against pagedserve.kernels.reference.sample_rows, on a step's logits."""
    from pagedserve.kernels import native_sample, reference

    vocab = args.vocab
    print(f"\nrandom draw from [rows, {vocab}] logits, {args.threads} thread(s); times in us; "
          f"x race = exponential race / native")
    print(f"{'case':38} {'race':>10} {'reference':>10} {'native':>9} {'x race':>7}")
    rows = []
    for dtype, dtype_name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        for batch in (1, 8, 32, 64):
            logits = torch.randn(batch, vocab).to(dtype) * 3
            uniforms = torch.rand(batch, dtype=torch.float64)
            t = time_interleaved({"race": lambda: _exponential_race(logits),
                                  "reference": lambda: reference.sample_rows(logits, uniforms),
                                  "native": lambda: native_sample.sample_rows(logits, uniforms)},
                                 min_time_s=args.min_time)
            name = f"sample {batch} rows {dtype_name}"
            rows.append(dict(kind="sample", case=name, dtype=dtype_name,
                             race_us=t["race"] * 1e6, reference_us=t["reference"] * 1e6,
                             native_us=t["native"] * 1e6, native_speedup_vs_race=t["race"] / t["native"]))
            print(f"{name:38} {t['race'] * 1e6:10.1f} {t['reference'] * 1e6:10.1f} {t['native'] * 1e6:9.1f} "
                  f"{t['race'] / t['native']:7.2f}", flush=True)
    return rows
