"""vLLM `LLM.generate` on a given workload; runs inside the vLLM virtual environment (not ours).

The workload is a JSON file of [prompt_token_ids, output_len] pairs written by bench/peers/offline.py,
so vLLM sees exactly the requests our engine sees. Greedy, `ignore_eos`, one untimed warm-up call.
The vLLM CPU settings (thread binding, KV-cache space) come from the environment:
bench/peers/vllm_env.py sets them.

    <vllm venv>/bin/python bench/peers/vllm_offline.py --workload W.json --model DIR --out R.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    with open(args.workload) as f:
        requests = json.load(f)
    began = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, disable_log_stats=True)
    startup_s = time.perf_counter() - began
    llm.generate({"prompt_token_ids": requests[0][0][:16]}, SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    rss_kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                 resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    import vllm
    result = {"seconds": elapsed, "output_tokens": generated, "tokens_per_s": generated / elapsed,
              "startup_s": startup_s, "peak_rss_mb": rss_kb / 1024, "vllm_version": vllm.__version__,
              "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
              "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs]}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
