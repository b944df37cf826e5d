"""Tensor parallelism's cost on one machine: the same Llama served with tensor_parallel_size 1
and 2 (two local ranks, gloo on CPU; NCCL where the ranks are GPUs), decode tok/s at batch 1 and
batch 64, alternating runs, medians and ratios; and where rank 0's step time goes: the per-layer
all-reduces (o_proj and down_proj each, plus the embedding's), the logits gather, the step-input
broadcast. On 2 shared cores TP=2 is not faster (both ranks share the cores TP=1 uses); the point
is what the split costs per layer.

The default model (SmolLM2-135M) has 9 attention heads, which 2 ranks cannot split (the engine
says so: the JSON records the message), so the model timed is a random-weight Llama of its
dimensions (30 layers, hidden 576, MLP 1536, vocab 49152) with 8 heads / 4 KV heads.

    python -m bench.tensor_parallel [--rounds 2] [--tokens 16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.common import write_result

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048)
BATCHES = (1, 64)
# (name, tensor_parallel_size, torch threads per rank): TP=1 on one core and on both, TP=2 on one
# core per rank. 2-thread torch collapses when other processes hold a core: both baselines show.
VARIANTS = (("tp1_1thread", 1, 1), ("tp1_2threads", 1, 2), ("tp2", 2, 1))
PROMPT_LEN = 16


def build_model(out_dir: Path) -> Path:
    import torch
    import transformers

    from tests.tiny_models import build_tokenizer
    if (out_dir / "config.json").exists():
        return out_dir
    build_tokenizer(out_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, rms_norm_eps=1e-5, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def default_model_message() -> str:
    """What the engine says to tensor_parallel_size=2 on the default model."""
    from pagedserve.replicas.model_files.default_model import resolve_model
    from pagedserve.replicas.models.loader import load_config
    from pagedserve.replicas.models import get_model_class
    from pagedserve.replicas.parallel.sharding import check_tensor_parallel
    from pagedserve.replicas.quant import quantization_of
    try:
        model = resolve_model(None)
        hf_config = load_config(model)
        check_tensor_parallel(hf_config, 2, get_model_class(hf_config),
                              quantized=quantization_of(model) is not None)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return str(exc)
    return "splits"


class Timers:
    """Wall time rank 0 spends in each collective (waiting for the other rank included)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1
        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def run(llm, batch: int, tokens: int, vocab: int, threads: int) -> tuple[float, float]:
    """(decode tok/s, seconds) for `batch` prompts of PROMPT_LEN tokens, `tokens` each, greedy."""
    import random

    import torch

    from pagedserve import SamplingParams
    torch.set_num_threads(threads)  # rank 0's (this process's)
    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]}
               for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    from pagedserve import LLM
    from pagedserve.replicas.parallel.executor import Workers
    from pagedserve.replicas.parallel.state import TensorParallel

    path = build_model(Path(tempfile.gettempdir()) / "pagedserve-bench-tp-llama")
    engine = dict(num_threads=2, num_kv_blocks=64 * (PROMPT_LEN + args.tokens) // 16 + 16,
                  max_num_seqs=64, enable_prefix_caching=False)
    timers = Timers()
    timers.wrap(TensorParallel, "all_reduce", "all_reduce")
    timers.wrap(TensorParallel, "gather_vocab", "gather_logits")
    timers.wrap(Workers, "send", "broadcast_step")
    llms = {1: LLM(str(path), **engine), 2: LLM(str(path), tensor_parallel_size=2, **engine)}
    for llm in llms.values():  # warm up
        run(llm, 4, 4, SHAPE["vocab_size"], 1)
    results: dict = {}
    try:
        for batch in BATCHES:
            rates = defaultdict(list)
            comm = defaultdict(list)
            for round_ in range(args.rounds):
                order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]  # alternate who goes first
                for name, tp, threads in order:
                    timers.reset()
                    steps_before = llms[tp].llm_engine.num_steps
                    rate, elapsed = run(llms[tp], batch, args.tokens, SHAPE["vocab_size"], threads)
                    rates[name].append(rate)
                    if tp == 2:
                        steps = llms[tp].llm_engine.num_steps - steps_before
                        comm["elapsed_s"].append(elapsed)
                        comm["steps"].append(steps)
                        for key in ("all_reduce", "gather_logits", "broadcast_step"):
                            comm[f"{key}_s"].append(timers.seconds[key])
                            comm[f"{key}_calls"].append(timers.calls[key])
            row = {f"{name}_tok_s": statistics.median(r) for name, r in rates.items()}
            row["tp2_vs_tp1_1thread"] = row["tp2_tok_s"] / row["tp1_1thread_tok_s"]
            row["tp2_vs_tp1_2threads"] = row["tp2_tok_s"] / row["tp1_2threads_tok_s"]
            elapsed = statistics.median(comm["elapsed_s"])
            for key in ("all_reduce", "gather_logits", "broadcast_step"):
                row[f"{key}_share"] = statistics.median(
                    s / e for s, e in zip(comm[f"{key}_s"], comm["elapsed_s"]))
            calls = statistics.median(comm["all_reduce_calls"])
            row["all_reduce_us_per_call"] = 1e6 * statistics.median(comm["all_reduce_s"]) / max(calls, 1)
            # Two all-reduces per layer (attention out, MLP out); the embedding's is one more per step.
            row["comm_us_per_layer_step"] = 2 * row["all_reduce_us_per_call"]
            row["steps"] = statistics.median(comm["steps"])
            row["tp2_elapsed_s"] = elapsed
            results[f"batch_{batch}"] = row
            print(f"batch {batch:3d}: TP=1 {row['tp1_1thread_tok_s']:6.1f} tok/s (1 thread), "
                  f"{row['tp1_2threads_tok_s']:6.1f} (2 threads); TP=2 {row['tp2_tok_s']:6.1f} tok/s "
                  f"({row['tp2_vs_tp1_1thread']:.2f}x, {row['tp2_vs_tp1_2threads']:.2f}x); "
                  f"TP=2 step time in all-reduce "
                  f"{100 * row['all_reduce_share']:.1f}%, logits gather "
                  f"{100 * row['gather_logits_share']:.1f}%, step broadcast "
                  f"{100 * row['broadcast_step_share']:.1f}%; "
                  f"{row['comm_us_per_layer_step']:.0f} us of all-reduce per layer per step", flush=True)
    finally:
        llms[2].shutdown()
    load = os.getloadavg()
    payload = {"model": {"shape": SHAPE, "weights": "random", "dtype": "float32"},
               "default_model_tp2": default_model_message(), "variants": VARIANTS,
               "tokens": args.tokens, "prompt_len": PROMPT_LEN, "rounds": args.rounds,
               "load_average": load, "results": results}
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; default model at TP=2: "
          f"{payload['default_model_tp2']}")
    print("wrote", write_result("tensor_parallel", payload))


if __name__ == "__main__":
    main()
