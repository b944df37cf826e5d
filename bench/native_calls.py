"""What calling a native kernel costs the host: the library's own Python entry points
(csrc/python_entry.c) against ctypes, per call and in batch-1 decode.

    python -m bench.native_calls [--threads 2] [--rounds 4] [--tokens 256] [--calls 20000]

Per call: the raw kernel call (no wrapper) at the default model's decode shapes (1 row), each
kernel through both bindings of the same library file in one process, timed in alternating
rounds, best of each. Decode: the default model as shipped (Q4_1 GGUF, fp32 activations),
batch 1, a 128-token prompt then --tokens greedy tokens, in child processes alternating
PAGEDSERVE_NATIVE_CALLS=ctypes and the default, medians of --rounds each; the children must
produce the same tokens. Writes bench/results/native_calls.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from bench.common import alternate_decode_children, cpu_info, time_interleaved, write_result

PROMPT_LEN = 128


def per_call(args) -> dict[str, dict[str, float]]:
    import ctypes

    import torch

    from bench.quant_gemm import random_quant
    from pagedserve.kernels import native, quant_linear

    torch.set_num_threads(args.threads)
    if native.calls() != "python":
        raise SystemExit("this library has no Python entry points (Python's headers missing?)")
    fast = native._library()
    slow = ctypes.CDLL(str(native.library_path()))
    native._declare(slow)
    gen = torch.Generator().manual_seed(0)
    packed = quant_linear.pack(random_quant(576, 576, 4, gen))
    perm, q, so, so_bits = packed.args
    x, out = torch.randn(1, 576), torch.empty(1, 576)
    kv = torch.randn(2, 64, 16, 3, 64)
    query, attn_out = torch.randn(1, 9, 64), torch.empty(1, 9, 64)
    table = torch.arange(16, dtype=torch.int32).view(1, 16)
    seq_lens, starts = torch.tensor([200], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    weight, residual = torch.ones(576), torch.randn(1, 576)
    cases = {
        "quant_linear (o, 576 x 576 int4)": lambda lib: lib.pagedserve_quant_linear(
            out.data_ptr(), x.data_ptr(), 576, perm, q, so, None, so_bits, 4, 32, 1, 576, 576,
            args.threads),
        "paged_decode_attention (200 tokens)": lambda lib: lib.pagedserve_paged_decode_attention(
            attn_out.data_ptr(), query.data_ptr(), 576, kv.data_ptr(), 64, 16, table.data_ptr(), 16,
            seq_lens.data_ptr(), starts.data_ptr(), 1, 1, 9, 3, 64, 0.125, 0, 0.0, 0, args.threads),
        "fused_add_rms_norm": lambda lib: lib.pagedserve_fused_add_rms_norm(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), 1, 576, 1e-5, 0, args.threads),
    }
    results = {}
    for name, case in cases.items():
        def repeat(lib, case=case):
            for _ in range(args.calls):
                case(lib)
        best = time_interleaved({"ctypes": lambda: repeat(slow), "python": lambda: repeat(fast)},
                                max_rounds=5)
        results[name] = {k: v / args.calls * 1e6 for k, v in best.items()}
    return results


def decode_child(args) -> None:
    from pagedserve import LLM, SamplingParams
    from pagedserve.replicas.model_files.default_model import find_default_gguf

    llm = LLM(str(find_default_gguf()), num_threads=args.threads, dtype="float32", kv_cache_memory_gb=0.5)
    prompt = list(range(1000, 1000 + PROMPT_LEN))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    m = output.metrics
    tokens = list(output.outputs[0].token_ids)
    print(json.dumps({"decode_tok_s": (len(tokens) - 1) / (m["finish_time"] - m["first_token_time"]),
                      "tokens": tokens}))


def decode(args) -> dict:
    runs, tokens = alternate_decode_children(
        "bench.native_calls", "PAGEDSERVE_NATIVE_CALLS", {"ctypes": "ctypes", "python": "python"},
        ["--threads", str(args.threads), "--tokens", str(args.tokens)], args.rounds)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    return {"runs_tok_s": runs, "median_tok_s": medians,
            "python_over_ctypes": medians["python"] / medians["ctypes"],
            "same_tokens": tokens["ctypes"] == tokens["python"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return decode_child(args)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} (level {cpu['level']}); load average {os.getloadavg()[0]:.2f}")
    calls = per_call(args)
    for name, r in calls.items():
        print(f"{name:>38}: ctypes {r['ctypes']:.2f} us, python entry {r['python']:.2f} us")
    print(f"batch-1 decode, default model, {args.threads} threads:")
    dec = decode(args)
    print(f"median decode tok/s: ctypes {dec['median_tok_s']['ctypes']:.1f}, python entry "
          f"{dec['median_tok_s']['python']:.1f} ({dec['python_over_ctypes']:.3f}x); same tokens: "
          f"{dec['same_tokens']}")
    path = write_result("native_calls", {"threads": args.threads, "tokens": args.tokens,
                                         "per_call_us": calls, "decode": dec})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
