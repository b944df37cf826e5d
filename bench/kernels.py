"""Paged-attention kernels against baselines measured in the same run.

    python -m bench.kernels --cpu     reference vs the torch fast path (and SDPA on contiguous K/V);
                                      float32: the native C decode and prefill kernels vs the torch path,
                                      and bench.cpu_ops: native RMSNorm / SiLU-and-mul vs their torch
                                      references, a step's projections: native GEMM vs MKL vs oneDNN;
                                      bfloat16 (AVX512-BF16 CPUs): the native bf16 GEMM's tiles vs
                                      torch's bf16 F.linear and oneDNN, and the fp32 GEMM;
                                      the random sampler's native draw vs the exponential race
    python -m bench.kernels           CUDA: Triton vs reference (correctness), decode KV bandwidth
                                      and prefill TFLOP/s, SDPA (flash) on contiguous K/V as baseline

Shapes default to the embedded model (SmolLM2-135M: 9 heads, 3 KV heads, head_dim 64, block 16).
Results go to bench/results/kernels_cpu.json or kernels_cuda.json.
The CPU mode measures one thread count (--threads): run it with 1 and with 2.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch
import torch.nn.functional as F

from bench.common import geomean, max_error, time_call, time_interleaved, write_result
from bench.cpu_ops import run_linear, run_linear_bf16, run_norm_act, run_sample
from pagedserve.kernels import cpu_features, native, reference, torch_attention
from pagedserve.kernels.backend import get_attention_backend
from pagedserve.kernels.metadata import AttentionMetadata

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Batch:
    """A scattered paged KV cache holding every sequence's context, plus the step's queries."""

    def __init__(self, seqs: list[tuple[int, int]], args, dtype: torch.dtype, device: str, seed=0):
        gen = torch.Generator().manual_seed(seed)
        bs = args.block_size
        counts = [(s + bs - 1) // bs for _, s in seqs]
        ids = torch.randperm(sum(counts), generator=gen).tolist()
        tables, taken = [], 0
        for n in counts:
            tables.append(ids[taken:taken + n])
            taken += n
        shape = (2, sum(counts), bs, args.kv_heads, args.head_dim)
        self.kv_cache = torch.randn(shape, dtype=dtype, device=device)
        num_tokens = sum(q for q, _ in seqs)
        self.query = torch.randn(num_tokens, args.heads, args.head_dim, dtype=dtype, device=device)
        self.key = torch.randn(num_tokens, args.kv_heads, args.head_dim, dtype=dtype, device=device)
        self.value = torch.randn_like(self.key)
        self.metadata = AttentionMetadata.build([q for q, _ in seqs], [s for _, s in seqs], tables,
                                                bs, device=device)
        self.scale = args.head_dim ** -0.5
        self.seqs = seqs

    def kv_bytes(self) -> int:
        """K and V bytes attention must read: every sequence's context, once."""
        token = 2 * self.kv_cache.shape[3] * self.kv_cache.shape[4] * self.kv_cache.element_size()
        return sum(s for _, s in self.seqs) * token

    def flops(self) -> int:
        """QK^T and PV multiply-adds over the causal (query, key) pairs, 2 FLOPs each."""
        pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in self.seqs)
        return 4 * pairs * self.query.shape[1] * self.query.shape[2]

    def contiguous_sdpa(self):
        """The same attention on contiguous per-sequence K/V: what paging costs is measured by this."""
        q_all, k_all, v_all, masks = [], [], [], []
        starts = self.metadata.query_start_loc.tolist()
        for b, (q_len, s_len) in enumerate(self.seqs):
            k, v = reference.gather_kv(self.kv_cache, self.metadata.block_tables[b], s_len)
            q_all.append(self.query[starts[b]:starts[b] + q_len].transpose(0, 1)[None].contiguous())
            k_all.append(k.transpose(0, 1)[None].contiguous())
            v_all.append(v.transpose(0, 1)[None].contiguous())
            if q_len == s_len:
                masks.append(None)
            else:
                q_pos = torch.arange(s_len - q_len, s_len, device=k.device)[:, None]
                masks.append(torch.arange(s_len, device=k.device)[None, :] <= q_pos)
        if all(q == 1 for q, _ in self.seqs) and len({s for _, s in self.seqs}) == 1:
            # A uniform decode batch is one batched call, as a contiguous cache would allow.
            q, k, v = torch.cat(q_all), torch.cat(k_all), torch.cat(v_all)
            return lambda: F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True)

        def run():
            for q, k, v, mask in zip(q_all, k_all, v_all, masks):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1,
                                               scale=self.scale, enable_gqa=True)
        return run


def decode(batch: int, context: int) -> list[tuple[int, int]]:
    return [(1, context)] * batch


def ragged_decode(batch: int, low: int, high: int, seed=0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(1, rng.randint(low, high)) for _ in range(batch)]


def cpu_cases(quick: bool):
    cases = [(f"decode B={b} ctx={c}", decode(b, c)) for b in (1, 16, 64) for c in (128, 512, 2048)
             if not (quick and b * c > 16 * 512)]
    cases += [("decode B=64 ctx=300", decode(64, 300)), ("decode B=16 ctx=1024", decode(16, 1024))]
    cases.append(("decode B=64 ctx=16..2048", ragged_decode(64, 16, 2048)))
    cases += [(f"prefill {q}", [(q, q)]) for q in (128, 512, 1024) if not (quick and q > 512)]
    cases.append(("chunk 512 after 1024 cached", [(512, 1536)]))
    cases.append(("mixed 256-chunk + 32 decodes ctx 512", [(256, 256)] + decode(32, 512)))
    return cases


def run_prefill_bf16(args) -> list[dict]:
    """bf16 prefill attention over a bf16 cache: the AVX512-BF16 tile (scores by vdpbf16ps) against
    the AVX-512 level's, which widens queries and keys to fp32, in the same run."""
    if not (native.available() and cpu_features.has_native_bf16()):
        return []
    from pagedserve.kernels import native_attention
    print(f"\nbf16 prefill attention, {args.threads} thread(s); times in ms; x avx512 = the avx512 "
          f"level's time / the avx512_bf16 level's")
    print(f"{'case':38} {'avx512':>9} {'bf16':>9} {'x avx512':>8} {'err':>8}")
    cases = [("8 prompts of 128", [(128, 128)] * 8), ("prefill 1024", [(1024, 1024)]),
             ("2 chunks of 512 after 1024 cached", [(512, 1536)] * 2)]
    rows = []
    for name, seqs in cases:
        b = Batch(seqs, args, torch.bfloat16, "cpu")
        m, out = b.metadata, torch.empty_like(b.query)

        def run(level):
            native_attention.paged_prefill_attention(out, b.query, b.kv_cache, m.block_tables,
                                                     m.seq_lens, m.query_start_loc, b.scale, level=level)
            return out
        err = max_error(run("avx512_bf16").float(),
                        reference.paged_attention(b.query, b.kv_cache, b.metadata, b.scale).float())
        t = time_interleaved({"avx512": lambda: run("avx512"), "bf16": lambda: run("avx512_bf16")},
                             min_time_s=args.min_time)
        rows.append(dict(kind="prefill_bf16", case=name, dtype="bfloat16", avx512_ms=t["avx512"] * 1e3,
                         bf16_ms=t["bf16"] * 1e3, bf16_speedup_vs_avx512=t["avx512"] / t["bf16"],
                         max_error=err))
        print(f"{name:38} {t['avx512'] * 1e3:9.3f} {t['bf16'] * 1e3:9.3f} "
              f"{t['avx512'] / t['bf16']:8.2f} {err:8.1e}", flush=True)
    return rows


def torch_path(query, kv_cache, metadata, scale):
    """The torch fast path with float32 decodes kept off the native kernel: its baseline."""
    return torch_attention.paged_attention(query, kv_cache, metadata, scale, use_native=False)


def run_cpu(args) -> None:
    torch.set_num_threads(args.threads)
    fast = get_attention_backend("torch", "cpu")
    auto = get_attention_backend("auto", "cpu")
    rows = []
    for dtype_name in args.dtype if "attention" in args.ops else []:
        dtype = DTYPES[dtype_name]
        with_native = dtype == torch.float32 and native.available()
        print(f"\n{dtype_name}, {args.threads} thread(s); times in ms; x ref = reference / torch, "
              f"x torch = torch / native (C), x sdpa = torch / contiguous SDPA")
        print(f"{'case':38} {'reference':>10} {'torch':>9} {'native':>9} {'sdpa':>8} {'x ref':>7} "
              f"{'x torch':>7} {'x sdpa':>7} {'err':>8}")
        for name, seqs in cpu_cases(args.quick):
            b = Batch(seqs, args, dtype, "cpu")
            expected = reference.paged_attention(b.query, b.kv_cache, b.metadata, b.scale)
            err = max_error(torch_path(b.query, b.kv_cache, b.metadata, b.scale), expected)
            contenders = {
                "reference": lambda: reference.paged_attention(b.query, b.kv_cache, b.metadata, b.scale),
                "torch": lambda: torch_path(b.query, b.kv_cache, b.metadata, b.scale),
                "sdpa": b.contiguous_sdpa()}
            has_native = with_native  # decodes and prefills alike run in C
            if has_native:
                contenders["native"] = lambda: fast.paged_attention(b.query, b.kv_cache, b.metadata, b.scale)
                err = max(err, max_error(contenders["native"](), expected))
            t = time_interleaved(contenders, min_time_s=args.min_time)
            t_ref, t_fast, t_sdpa = t["reference"], t["torch"], t["sdpa"]
            row = dict(kind="attention", case=name, dtype=dtype_name, reference_ms=t_ref * 1e3,
                       torch_ms=t_fast * 1e3, sdpa_contiguous_ms=t_sdpa * 1e3,
                       speedup_vs_reference=t_ref / t_fast, slowdown_vs_sdpa=t_fast / t_sdpa, max_error=err)
            native_cols = f"{'':>9}", f"{'':>7}"
            if has_native:
                t_native = t["native"]
                row.update(native_ms=t_native * 1e3, native_speedup_vs_torch=t_fast / t_native,
                           decodes=any(q == 1 for q, _ in seqs))
                native_cols = f"{t_native * 1e3:9.2f}", f"{t_fast / t_native:7.2f}"
            rows.append(row)
            print(f"{name:38} {t_ref * 1e3:10.2f} {t_fast * 1e3:9.2f} {native_cols[0]} {t_sdpa * 1e3:8.2f} "
                  f"{t_ref / t_fast:7.2f} {native_cols[1]} {t_fast / t_sdpa:7.2f} {err:8.1e}", flush=True)
        stores = [("store_kv 64 decode tokens", decode(64, 512)), ("store_kv 1024 prefill tokens", [(1024, 1024)])]
        for name, seqs in stores:
            b = Batch(seqs, args, dtype, "cpu")
            slots = b.metadata.slot_mapping
            t = time_interleaved({"reference": lambda: reference.store_kv(b.key, b.value, b.kv_cache, slots),
                                  "torch": lambda: fast.store_kv(b.key, b.value, b.kv_cache, slots)},
                                 min_time_s=args.min_time)
            t_ref, t_fast = t["reference"], t["torch"]
            rows.append(dict(kind="store_kv", case=name, dtype=dtype_name, reference_ms=t_ref * 1e3,
                             torch_ms=t_fast * 1e3, speedup_vs_reference=t_ref / t_fast))
            print(f"{name:38} {t_ref * 1e3:10.3f} {t_fast * 1e3:9.3f} {'':>9} {'':>8} {t_ref / t_fast:7.2f}")
    if "bfloat16" in args.dtype and "attention" in args.ops:
        rows += run_prefill_bf16(args)
    if "float32" in args.dtype and native.available() and "norm_act" in args.ops:
        rows += run_norm_act(args)
    if "float32" in args.dtype and "linear" in args.ops:
        rows += run_linear(args)
    if "bfloat16" in args.dtype and "linear" in args.ops:
        rows += run_linear_bf16(args)
    if native.available() and "sample" in args.ops:
        rows += run_sample(args)
    print()
    for dtype_name in args.dtype:
        for kind in ("attention", "store_kv"):
            ratios = [r["speedup_vs_reference"] for r in rows if r["dtype"] == dtype_name and r["kind"] == kind]
            if ratios:
                print(f"{dtype_name} {kind}: torch is {geomean(ratios):.2f}x the reference's speed (geomean)")
        for decodes, cases in ((True, "cases with decodes"), (False, "prefill-only cases")):
            ratios = [r["native_speedup_vs_torch"] for r in rows
                      if r["dtype"] == dtype_name and r.get("decodes") is decodes]
            if ratios:
                print(f"{dtype_name} attention: native is {geomean(ratios):.2f}x the torch path's "
                      f"speed (geomean, {len(ratios)} {cases})")
    ratios = [r["speedup_vs_torch"] for r in rows if r["kind"] == "norm_act"]
    if ratios:
        print(f"float32 norm/act: native is {geomean(ratios):.2f}x the torch formulas' speed (geomean)")
    for baseline in ("mkl", "onednn"):
        ratios = [r[f"native_speedup_vs_{baseline}"] for r in rows if f"native_speedup_vs_{baseline}" in r]
        if ratios:
            print(f"float32 projections: native is {geomean(ratios):.2f}x {baseline}'s speed "
                  f"(geomean over {len(ratios)} row counts)")
    for baseline in ("torch", "onednn", "fp32"):
        ratios = [r[f"native_bf16_speedup_vs_{baseline}"] for r in rows if f"native_bf16_speedup_vs_{baseline}" in r]
        if ratios:
            print(f"bf16 projections: native bf16 is {geomean(ratios):.2f}x {baseline}'s speed "
                  f"(geomean over {len(ratios)} row counts)")
    timed = [r for r in rows if "speedup_vs_reference" in r]
    losses = [r for r in timed if r["speedup_vs_reference"] < 1.0]
    winner = "torch" if not losses else "mixed"
    print(f"auto on CPU -> {auto.name!r}; torch beats reference in {len(timed) - len(losses)}/{len(timed)} cases")
    for r in losses:
        print(f"  reference faster: {r['case']} ({r['dtype']}) x{r['speedup_vs_reference']:.2f}")
    path = write_result("kernels_cpu", dict(threads=args.threads, auto_backend=auto.name, winner=winner,
                                            native=native.available(), shape=shape_of(args), rows=rows))
    print(f"wrote {path}")


def shape_of(args) -> dict:
    return dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size)


def run_cuda(args) -> None:
    from pagedserve.kernels import triton_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: --smoke under TRITON_INTERPRET=1
    if device == "cuda":
        from triton.testing import do_bench

        def timed(fn):  # do_bench flushes L2 between calls, so KV reads come from HBM
            return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3
    else:
        def timed(fn):
            return time_call(fn, min_time_s=0.0, max_reps=1)
    dtype = DTYPES[args.dtype[0]]
    tri = get_attention_backend("triton", device)
    rows, failures = [], 0

    # Correctness first: every path of the Triton backend against the spec, on this device.
    checks = [[(1, 1), (1, 17), (1, 300)], [(37, 37), (1, 40), (9, 200), (1, 1000)], decode(4, 3000)]
    for seqs in checks[:2] if args.smoke else checks:
        for splits in (1, None, 4):
            b = Batch(seqs, args, dtype, device)
            cache_ref, cache_tri = b.kv_cache.clone(), b.kv_cache.clone()
            reference.store_kv(b.key, b.value, cache_ref, b.metadata.slot_mapping)
            tri.store_kv(b.key, b.value, cache_tri, b.metadata.slot_mapping)
            expected = reference.paged_attention(b.query, cache_ref, b.metadata, b.scale)
            actual = triton_attention.paged_attention(b.query, cache_tri, b.metadata, b.scale, num_splits=splits)
            err = max_error(actual, expected)
            ok = torch.equal(cache_ref, cache_tri) and err < {torch.float32: 1e-4}.get(dtype, 2e-2)
            failures += not ok
            rows.append(dict(kind="check", seqs=len(seqs), num_splits=splits, max_error=err, ok=ok))
            print(f"check {len(seqs)} seqs splits={splits}: max error {err:.1e} {'ok' if ok else 'FAIL'}")

    kv_token = 2 * args.kv_heads * args.head_dim * torch.tensor([], dtype=dtype).element_size()
    print(f"\ndecode, {args.dtype[0]}: effective KV read GB/s (fraction of {args.peak_gbps:.0f} GB/s peak); "
          f"x sdpa = contiguous SDPA time / Triton time")
    print(f"{'batch':>6} {'ctx':>6} {'splits':>6} {'GB/s':>8} {'peak':>6} {'no-split GB/s':>13} {'x sdpa':>7}")
    grid = [(b, c) for b in args.batches for c in args.contexts if b * c * kv_token <= args.max_kv_gb * 2**30]
    for batch, context in ([(2, 64), (1, 200)] if args.smoke else grid):
        b = Batch(decode(batch, context), args, dtype, device)
        splits = triton_attention.choose_num_splits(b.metadata, b.kv_cache, b.query.shape[1])
        t_auto = timed(lambda: tri.paged_attention(b.query, b.kv_cache, b.metadata, b.scale))
        t_one = timed(lambda: triton_attention.paged_attention(b.query, b.kv_cache, b.metadata, b.scale,
                                                               num_splits=1))
        t_sdpa = timed(b.contiguous_sdpa())
        gbps, gbps_one = b.kv_bytes() / t_auto / 1e9, b.kv_bytes() / t_one / 1e9
        rows.append(dict(kind="decode", batch=batch, context=context, num_splits=splits, triton_s=t_auto,
                         triton_no_split_s=t_one, sdpa_contiguous_s=t_sdpa, gbps=gbps,
                         fraction_of_peak=gbps / args.peak_gbps, speedup_vs_sdpa=t_sdpa / t_auto))
        print(f"{batch:6} {context:6} {splits:6} {gbps:8.0f} {gbps / args.peak_gbps:6.1%} {gbps_one:13.0f} "
              f"{t_sdpa / t_auto:7.2f}", flush=True)

    print(f"\nprefill, {args.dtype[0]}: TFLOP/s (causal FLOPs only); x sdpa = contiguous SDPA time / Triton time")
    print(f"{'seqs':>5} {'q_len':>6} {'cached':>6} {'TFLOP/s':>8} {'sdpa':>8} {'x sdpa':>7}")
    prefills = [(4, 512, 0), (2, 2048, 0), (1, 8192, 0), (4, 512, 2048), (1, 2048, 8192)]
    for num_seqs, q_len, cached in ([(1, 20, 0), (1, 9, 30)] if args.smoke else prefills):
        b = Batch([(q_len, q_len + cached)] * num_seqs, args, dtype, device)
        t_tri = timed(lambda: tri.paged_attention(b.query, b.kv_cache, b.metadata, b.scale))
        t_sdpa = timed(b.contiguous_sdpa())
        tflops, sdpa_tflops = b.flops() / t_tri / 1e12, b.flops() / t_sdpa / 1e12
        rows.append(dict(kind="prefill", seqs=num_seqs, query_len=q_len, cached=cached, triton_s=t_tri,
                         sdpa_contiguous_s=t_sdpa, tflops=tflops, speedup_vs_sdpa=t_sdpa / t_tri))
        print(f"{num_seqs:5} {q_len:6} {cached:6} {tflops:8.2f} {sdpa_tflops:8.2f} {t_sdpa / t_tri:7.2f}",
              flush=True)

    name = "kernels_cuda" if device == "cuda" else "kernels_cuda_smoke"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    path = write_result(name, dict(device=device_name, dtype=args.dtype[0], peak_gbps=args.peak_gbps,
                                   shape=shape_of(args), failures=failures, rows=rows))
    print(f"wrote {path}")
    if failures:
        sys.exit(1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="benchmark the CPU paths")
    p.add_argument("--dtype", default=None, help="comma-separated: float32,bfloat16,float16")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: steady when cores are shared)")
    p.add_argument("--quick", action="store_true", help="CPU: skip the largest shapes")
    p.add_argument("--ops", default="attention,norm_act,linear,sample",
                   help="CPU: comma-separated parts to run (attention, norm_act, linear, sample)")
    p.add_argument("--min-time", type=float, default=0.3, help="CPU: seconds of repeats per measurement")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=576, help="CPU norm/act: hidden size")
    p.add_argument("--intermediate", type=int, default=1536, help="CPU norm/act: MLP intermediate size")
    p.add_argument("--layers", type=int, default=30, help="CPU projections: decoder layers per step")
    p.add_argument("--vocab", type=int, default=49152, help="CPU projections: lm_head rows")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="device memory bandwidth (H200: 4800)")
    p.add_argument("--batches", default="1,8,32,64,256", help="CUDA decode batch sizes")
    p.add_argument("--contexts", default="512,2048,8192,32768", help="CUDA decode context lengths")
    p.add_argument("--max-kv-gb", type=float, default=16.0, help="CUDA: skip decode shapes with more KV")
    p.add_argument("--smoke", action="store_true",
                   help="run the CUDA script's code paths at toy sizes (on CPU under TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    args.dtype = (args.dtype or ("float32,bfloat16" if args.cpu else "bfloat16")).split(",")
    args.ops = args.ops.split(",")
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    if args.cpu:
        run_cpu(args)
    elif torch.cuda.is_available() or (args.smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        run_cuda(args)
    else:
        sys.exit("no CUDA device: use --cpu (or --smoke with TRITON_INTERPRET=1 to exercise the CUDA script)")


if __name__ == "__main__":
    main()
