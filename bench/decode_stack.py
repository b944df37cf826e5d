"""Decode through every layer in one native call (kernels/decoder_layers.py) against the layer
loop it replaces, on the default model as shipped (Q4_1 GGUF, fp32 activations).

    python -m bench.decode_stack [--threads 2] [--rounds 4] [--batches 1,4,16] [--tokens 128]

Each batch size: --batches sequences of 128-token prompts, then --tokens greedy tokens each
(ignore_eos), in child processes alternating PAGEDSERVE_FUSED_DECODE=0 and the default; decode
tok/s is the output tokens after each sequence's first over the time from the first first token
to the last finish; medians of --rounds each. The two must produce the same tokens.
Writes bench/results/decode_stack.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from bench.common import alternate_decode_children, cpu_info, write_result

PROMPT_LEN = 128
SETTINGS = {"layer loop": "0", "one call": "1"}


def child(args) -> None:
    from pagedserve import LLM, SamplingParams
    from pagedserve.replicas.model_files.default_model import find_default_gguf

    llm = LLM(str(find_default_gguf()), num_threads=args.threads, dtype="float32", kv_cache_memory_gb=0.5)
    prompts = [{"prompt_token_ids": list(range(1000 + 7 * i, 1000 + 7 * i + PROMPT_LEN))}
               for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    first = min(o.metrics["first_token_time"] for o in outputs)
    last = max(o.metrics["finish_time"] for o in outputs)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps({"decode_tok_s": sum(len(t) - 1 for t in tokens) / (last - first), "tokens": tokens}))


def run(args, batch: int) -> dict:
    runs, tokens = alternate_decode_children(
        "bench.decode_stack", "PAGEDSERVE_FUSED_DECODE", SETTINGS,
        ["--batch", str(batch), "--threads", str(args.threads), "--tokens", str(args.tokens)],
        args.rounds, label=f"batch {batch:3d} ")
    medians = {k: statistics.median(v) for k, v in runs.items()}
    return {"batch": batch, "runs_tok_s": runs, "median_tok_s": medians,
            "speedup": medians["one call"] / medians["layer loop"],
            "same_tokens": tokens["one call"] == tokens["layer loop"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} (level {cpu['level']}); load average {os.getloadavg()[0]:.2f}")
    results = [run(args, int(b)) for b in args.batches.split(",")]
    for r in results:
        m = r["median_tok_s"]
        print(f"batch {r['batch']:3d}: layer loop {m['layer loop']:.1f}, one call {m['one call']:.1f} tok/s "
              f"({r['speedup']:.2f}x); same tokens: {r['same_tokens']}")
    path = write_result("decode_stack", {"threads": args.threads, "tokens": args.tokens,
                                         "prompt_len": PROMPT_LEN, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
