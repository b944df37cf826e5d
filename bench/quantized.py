"""Quantized vs float32 on the default model (SmolLM2-135M): decode throughput and memory.

    python -m bench.quantized                          # fp32 vs Q4_1 as shipped, batch 1/8/64
    python -m bench.quantized --formats float32,gguf-q4_1,gguf-q8_0,gptq-w4g32,awq-w4g32,ct-w8a16
    python -m bench.quantized --rounds 3 --threads 2

Formats: `float32` (the converted default checkpoint), `gguf-q4_1` (the GGUF file the package
ships, as it is), and checkpoints quantized here from the float32 weights in each real on-disk
layout (tests/quant_checkpoints.py writes them: round-to-nearest, so they measure speed and
memory, not quantization quality): `gguf-<type>` (q8_0, q4_0, q4_k, q6_k ...), `gptq-w4g<G>`,
`awq-w4g<G>`, `ct-w4a16`, `ct-w8a16`. A suffix `-a8` (e.g. `gguf-q4_1-a8`) runs that checkpoint
with int8 activations (PAGEDSERVE_QUANT_ACTIVATIONS=int8, kernels/quant_linear.py), which is
faster and not token-exact.

Each format runs in its own subprocess (peak RSS is its own), formats alternate within each
round, and each line reports the median round. Output tokens/s of greedy decoding with
ignore_eos (16-token prompts, 64 new tokens), at each batch size, and the CPU time per output
token (the machines are shared: CPU time is steadier than wall time); the weights' bytes as the
model holds them (packed) and the process's peak RSS. Ratios are against the first format.
Writes bench/results/quantized.json and quantized.png.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import cpu_info, write_result

PROMPT_LEN, NEW_TOKENS = 16, 64


def weight_bytes(model) -> int:
    """Bytes of every weight as the model holds it: packed copies, quantized ones, the rest."""
    from pagedserve.replicas.models.layers import Embedding, Linear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Linear):
            if module.packed_quant is not None:
                total += sum(part.nbytes for part in module.packed_quant)
            elif module.packed is not None and module.packed.replaces_weight:
                total += module.packed.tensor.numel() * module.packed.tensor.element_size()
        elif isinstance(module, Embedding) and module.quantized is not None:
            total += module.quantized.nbytes
    packed = getattr(model, "tied_lm_head_packed", None)
    if packed is not None:  # a tied lm_head's own packed copy
        total += packed.nbytes if hasattr(packed, "nbytes") else packed.tensor.numel() * packed.tensor.element_size()
    return total


def child(args) -> None:
    from pagedserve import LLM, SamplingParams

    llm = LLM(args.model_path, num_threads=args.threads, max_num_seqs=max(args.batches),
              kv_cache_memory_gb=1.0, dtype="float32")
    model = llm.llm_engine.runner.model
    prompt = list(range(100, 100 + PROMPT_LEN))
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4), use_tqdm=False)
    result = {"weight_bytes": weight_bytes(model), "tok_s": {}, "cpu_ms_per_tok": {}}
    for batch in args.batches:
        prompts = [{"prompt_token_ids": [t + i for t in prompt]} for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        start, cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result["tok_s"][str(batch)] = tokens / elapsed
        result["cpu_ms_per_tok"][str(batch)] = cpu / tokens * 1e3
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def make_checkpoint(fmt: str, fp32_dir: Path, out: Path) -> Path:
    """The checkpoint a format names (float32 and the shipped GGUF exist already)."""
    from pagedserve.replicas.model_files.default_model import find_default_gguf
    from tests import quant_checkpoints as qc

    if fmt == "float32":
        return fp32_dir
    if fmt == "gguf-q4_1":
        return find_default_gguf()
    kind, _, variant = fmt.partition("-")
    if kind == "gguf":
        # Embedding and lm_head as the shipped file has them (Q8_0), the projections in the type.
        return qc.write_gguf(fp32_dir, out / f"{variant}.gguf", variant.upper(), embedding_type="Q8_0")[0]
    if kind in ("gptq", "awq"):
        group = int(variant.split("g")[1])
        if kind == "gptq":
            qc.write_gptq(fp32_dir, out / fmt, bits=4, group_size=group)
        else:
            qc.write_awq(fp32_dir, out / fmt, group_size=group)
        return out / fmt
    if kind == "ct":
        qc.write_compressed_tensors(fp32_dir, out / fmt, bits=int(variant[1]))
        return out / fmt
    raise ValueError(f"unknown format {fmt!r}")


INT8_SUFFIX = "-a8"


def run_child(model_path: Path, threads: int, batches: list[int], int8: bool = False) -> dict:
    from pagedserve.kernels.quant_linear import ACTIVATIONS_ENV

    cmd = [sys.executable, "-m", "bench.quantized", "--child", str(model_path),
           "--threads", str(threads), "--batches", ",".join(map(str, batches))]
    env = {**os.environ, ACTIVATIONS_ENV: "int8" if int8 else "float32"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{model_path}: child failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def plot(path: Path, formats: list[str], medians: dict, batches: list[int]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(formats)
    for i, fmt in enumerate(formats):
        left.bar([b + i * width for b in range(len(batches))],
                 [medians[fmt]["tok_s"][str(b)] for b in batches], width, label=fmt)
    left.set_xticks([b + 0.4 - width / 2 for b in range(len(batches))], [f"batch {b}" for b in batches])
    left.set_ylabel("output tokens/s")
    left.legend(fontsize=8)
    right.bar(formats, [medians[f]["weight_bytes"] / 2**20 for f in formats])
    right.set_ylabel("weights (MiB, as held)")
    right.tick_params(axis="x", rotation=30)
    fig.suptitle(f"SmolLM2-135M decode, {cpu_info()['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="float32,gguf-q4_1")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        args.model_path = args.child
        child(args)
        return

    from pagedserve.replicas.model_files.default_model import ensure_default_model
    formats = args.formats.split(",")
    fp32_dir = ensure_default_model()
    workdir = Path(tempfile.mkdtemp(prefix="bench-quantized-"))
    paths = {fmt: make_checkpoint(fmt.removesuffix(INT8_SUFFIX), fp32_dir, workdir) for fmt in formats}
    rounds: dict[str, list[dict]] = {fmt: [] for fmt in formats}
    for r in range(args.rounds):
        for fmt in formats if r % 2 == 0 else reversed(formats):  # alternate the order too
            rounds[fmt].append(run_child(paths[fmt], args.threads, args.batches,
                                         fmt.endswith(INT8_SUFFIX)))
            run = rounds[fmt][-1]
            print(f"round {r + 1} {fmt}: " + ", ".join(
                f"b{b} {run['tok_s'][str(b)]:.0f} tok/s {run['cpu_ms_per_tok'][str(b)]:.1f} cpu-ms/tok"
                for b in args.batches) + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    medians = {fmt: {"tok_s": {str(b): statistics.median(x["tok_s"][str(b)] for x in runs)
                               for b in args.batches},
                     "cpu_ms_per_tok": {str(b): statistics.median(x["cpu_ms_per_tok"][str(b)]
                                                                  for x in runs) for b in args.batches},
                     "weight_bytes": runs[0]["weight_bytes"],
                     "peak_rss_mb": statistics.median(x["peak_rss_mb"] for x in runs)}
               for fmt, runs in rounds.items()}
    base = formats[0]
    print(f"\n{'format':>12} " + " ".join(f"{'b' + str(b) + ' tok/s':>11} {'ratio':>6}" for b in args.batches)
          + f" {'weights MiB':>12} {'peak RSS MB':>12}")
    for fmt in formats:
        m = medians[fmt]
        cells = " ".join(f"{m['tok_s'][str(b)]:>11.0f} {m['tok_s'][str(b)] / medians[base]['tok_s'][str(b)]:>5.2f}x"
                         for b in args.batches)
        print(f"{fmt:>12} {cells} {m['weight_bytes'] / 2**20:>12.1f} {m['peak_rss_mb']:>12.0f}")
    print("CPU ms per output token: " + "; ".join(
        f"{fmt} " + " ".join(f"b{b} {medians[fmt]['cpu_ms_per_tok'][str(b)]:.2f}" for b in args.batches)
        for fmt in formats) + f" (load average {os.getloadavg()[0]:.1f})")
    path = write_result("quantized", {"formats": formats, "batches": args.batches,
                                      "threads": args.threads, "rounds": args.rounds,
                                      "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
                                      "medians": medians, "runs": rounds})
    plot(path.with_suffix(".png"), formats, medians, args.batches)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
