"""Multi-LoRA throughput against the base model, measured in the same run, on the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF, default dtype).

    python -m bench.lora                                 # base; 1, 4, 16 adapters at rank 8 and 64
    python -m bench.lora --ranks 8 --adapters 4,16 --repeats 5 --threads 2
    python -m bench.lora --quick                         # smoke run: 8 requests, 16 tokens, 1 repeat

Random PEFT adapters (lora_A / lora_B on q, k, v, o, gate, up and down of every layer, normal *
0.01, lora_alpha = 2r) are written to a temp dir. Engines: a plain one (no enable_lora: the true
baseline) and, per rank, one with enable_lora, max_loras=16, max_lora_rank=rank that runs the base
model alone (`rR base`) and N distinct adapters (`rR xN`, the requests round-robin over them).
Each engine is warmed up once with every adapter, so loads are not timed. Each repetition runs
every case once, alternating (the order reversed every other repetition), each run with fresh
random prompts so that no run hits the prefix cache. Workload: --requests prompts of 64 random
token ids, --max-tokens greedy tokens each (ignore_eos). Reports the median output tok/s (output
tokens over generate()'s wall time, prefill included) and its ratio to the plain base, and checks
the issue's goals on it: >= 0.8x at 4 adapters of rank 8, >= 0.6x at 16 adapters of rank 64. Also
the median CPU time per output token and the base's over it (a "cpu ratio"): on shared cores
other processes only stretch wall time, so that one is the steadier. Writes
bench/results/lora.json and lora.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import cpu_info, write_result

PROMPT_LEN = 64
MAX_LORAS = 16
# The default model's projections: (in, out) of each PEFT target (hidden 576, 3 KV heads of 64,
# intermediate 1536), in all of its 30 layers.
LAYERS = 30
SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
          "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
GOALS = [("r8 x4", 0.8), ("r64 x16", 0.6)]


def write_adapter(out_dir: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter directory with random weights, as peft's save_pretrained lays it out."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for target, (fan_in, fan_out) in SHAPES.items():
            module = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SHAPES),
         "bias": "none"}))
    return out_dir


def make_engine(args, rank: int | None):
    from pagedserve import LLM

    lora = {} if rank is None else {"enable_lora": True, "max_loras": MAX_LORAS, "max_lora_rank": rank}
    return LLM(None, num_threads=args.threads, max_num_seqs=32, **lora)


def prompts_for(args, seed: int, vocab_size: int) -> list[dict]:
    rng = random.Random(seed)
    # Above the low ids, where the tokenizer keeps its special tokens.
    return [{"prompt_token_ids": [rng.randrange(100, vocab_size) for _ in range(PROMPT_LEN)]}
            for _ in range(args.requests)]


def run_case(llm, prompts: list[dict], max_tokens: int, loras: list) -> dict:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "cpu_ms_per_tok": cpu / tokens * 1e3,
            "output_tokens": tokens}


def plot(path: Path, cases: list[str], medians: dict, cpu_ratios: dict, cpu: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = medians["base"]
    fig, (ax, right) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(cases)), 4))
    colors = ["tab:gray" if c == "base" else "tab:blue" if "r8" in c else "tab:orange" for c in cases]
    bars = ax.bar(cases, [medians[c] for c in cases], color=colors)
    for bar, case in zip(bars, cases):
        ax.annotate(f"{medians[case] / base:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(base, color="tab:gray", linestyle="--", linewidth=0.8)
    ax.set_ylabel("output tokens/s (median)")
    ax.tick_params(axis="x", rotation=30)
    right.bar(cases, [cpu_ratios[c] for c in cases], color=colors)
    right.axhline(1.0, color="tab:gray", linestyle="--", linewidth=0.8)
    right.set_ylabel("base CPU-ms/token over the case's")
    right.tick_params(axis="x", rotation=30)
    fig.suptitle(f"SmolLM2-135M multi-LoRA, {cpu['model']} ({cpu['level']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,64", help="adapter ranks, one LoRA engine each")
    parser.add_argument("--adapters", default="1,4,16", help=f"distinct adapters per case (<= {MAX_LORAS})")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 requests, 16 tokens, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.repeats = 8, 16, 1
    ranks = [int(r) for r in args.ranks.split(",") if r]
    counts = [int(n) for n in args.adapters.split(",") if n]
    if any(not 1 <= n <= MAX_LORAS for n in counts):
        parser.error(f"--adapters: each count must be 1..{MAX_LORAS}")

    from pagedserve import LoRARequest

    cpu = cpu_info()
    print(f"CPU: {cpu['model']} (level {cpu['level']}, flags {' '.join(cpu['flags'])}), "
          f"{cpu['num_cpus']} CPUs, {args.threads} threads; load average {os.getloadavg()[0]:.2f}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = {r: [LoRARequest(f"r{r}-{i}", i + 1, str(write_adapter(workdir / f"r{r}-{i}", r, 1000 * r + i)))
                    for i in range(max(counts, default=0))] for r in ranks}
    engines = {"base": make_engine(args, None)} | {r: make_engine(args, r) for r in ranks}
    # case -> (engine, the adapters its requests round-robin over; none: the base model)
    cases = {"base": (engines["base"], [])}
    for r in ranks:
        cases[f"r{r} base"] = (engines[r], [])
        cases.update({f"r{r} x{n}": (engines[r], adapters[r][:n]) for n in counts})
    first = engines["base"].llm_engine
    stats = first.stats()
    vocab_size = first.tokenizer.vocab_size
    print(f"model dtype {stats.get('dtype')}, {args.requests} requests x {PROMPT_LEN} prompt + "
          f"{args.max_tokens} new tokens, max_num_seqs 32, {args.repeats} repeats", flush=True)

    warm = prompts_for(args, 0, vocab_size)[:1] * (MAX_LORAS + 1)
    for key, llm in engines.items():
        loras = [None, *adapters[key]] if key != "base" else []
        run_case(llm, warm[:max(1, len(loras))], 2, loras)

    names = list(cases)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.repeats):
        for i, name in enumerate(names if rep % 2 == 0 else reversed(names)):
            llm, loras = cases[name]
            run = run_case(llm, prompts_for(args, 1 + rep * len(names) + i, vocab_size), args.max_tokens, loras)
            runs[name].append(run)
            print(f"  repeat {rep + 1} {name:>10}: {run['tok_s']:7.1f} tok/s "
                  f"{run['cpu_ms_per_tok']:6.2f} cpu-ms/tok", flush=True)

    medians = {name: statistics.median(r["tok_s"] for r in runs[name]) for name in names}
    cpu_ms = {name: statistics.median(r["cpu_ms_per_tok"] for r in runs[name]) for name in names}
    base = medians["base"]
    cpu_ratios = {name: cpu_ms["base"] / cpu_ms[name] for name in names}
    print(f"\n{'case':>10} {'tok/s':>8} {'vs base':>8} {'cpu-ms/tok':>11} {'cpu ratio':>10}")
    for name in names:
        print(f"{name:>10} {medians[name]:>8.1f} {medians[name] / base:>7.2f}x {cpu_ms[name]:>11.2f} "
              f"{cpu_ratios[name]:>9.2f}x")
    goals = []
    for name, goal in GOALS:
        ratio = medians[name] / base if name in medians else None
        verdict = "NOT RUN" if ratio is None else "PASS" if ratio >= goal else "FAIL"
        goals.append({"case": name, "goal": goal, "ratio": ratio, "cpu_ratio": cpu_ratios.get(name),
                      "verdict": verdict})
        shown = "-" if ratio is None else f"{ratio:.2f}x (cpu ratio {cpu_ratios[name]:.2f}x)"
        print(f"{verdict}: {name} at {shown} of base tok/s (goal >= {goal}x)")
    print(f"load average {os.getloadavg()[0]:.2f}")

    lora_stats = {f"r{r}": {k: v for k, v in engines[r].llm_engine.stats().items()
                            if k in ("lora_loads", "lora_evictions", "lora_slot_loads")} for r in ranks}
    path = write_result("lora", {
        "threads": args.threads, "requests": args.requests, "prompt_len": PROMPT_LEN,
        "max_tokens": args.max_tokens, "repeats": args.repeats, "quick": args.quick,
        "dtype": stats.get("dtype"), "ranks": ranks, "adapter_counts": counts,
        "median_tok_s": medians, "ratio_vs_base": {n: medians[n] / base for n in names},
        "median_cpu_ms_per_tok": cpu_ms, "cpu_ratio_vs_base": cpu_ratios,
        "goals": goals, "runs": runs, "lora_stats": lora_stats})
    plot(path.with_suffix(".png"), names, medians, cpu_ratios, cpu)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
