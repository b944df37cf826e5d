"""Every supported model family: offline tok/s of pagedserve vs transformers static batching.

For each family a ~100M-parameter random config (checkpoint written to a temp dir, the tiny test
tokenizer beside it), one seeded workload of mixed prompt and output lengths, both systems in
this process with the same thread count, alternating `--rounds` times (medians). Mixtral's step
time is also compared with a dense Llama of the same active parameters (its experts' width times
top-k as the MLP width), both on pagedserve.

    python -m bench.models [--families gpt2,mixtral] [--rounds 1] [--threads 1] [--num-requests 16]
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import write_result

VOCAB = 32000
_GATED = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
              head_dim=64, intermediate_size=2048, max_position_embeddings=2048)
_PLAIN = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
              max_position_embeddings=2048)
# family -> (transformers config class, fields); ~100M parameters each (Mixtral: ~100M active).
CONFIGS = {
    "llama": ("LlamaConfig", dict(_GATED, tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, n_positions=2048)),
    "gpt_neox": ("GPTNeoXConfig", dict(_PLAIN, rotary_pct=0.25, use_parallel_residual=True)),
    "opt": ("OPTConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072,
                              max_position_embeddings=2048)),
    "qwen3": ("Qwen3Config", dict(_GATED, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(_GATED, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(_GATED, sliding_window=32, query_pre_attn_scalar=64)),
    "gemma3": ("Gemma3TextConfig", dict(_GATED, sliding_window=32, query_pre_attn_scalar=64)),
    "mixtral": ("MixtralConfig", dict(_GATED, intermediate_size=1024, num_local_experts=8,
                                      num_experts_per_tok=2)),
}
# Mixtral's comparison: the same model with one dense MLP as wide as the active experts together.
DENSE_OF_MOE = ("LlamaConfig", dict(_GATED, intermediate_size=2 * 1024))


def build_checkpoint(out_dir: Path, config_name: str, fields: dict):
    import torch
    import transformers

    from tests.tiny_models import build_tokenizer

    tokenizer = build_tokenizer(out_dir)
    config = getattr(transformers, config_name)(vocab_size=VOCAB, bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id,
                                                pad_token_id=tokenizer.pad_token_id, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [([rng.randrange(3, 380) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]


def run_pagedserve(model_dir: Path, requests, threads: int) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", num_threads=threads, kv_cache_memory_gb=0.25)
    llm.generate({"prompt_token_ids": requests[0][0][:8]}, SamplingParams(max_tokens=2), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    steps_before = llm.llm_engine.stats()["num_steps"]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_steps = llm.llm_engine.stats()["num_steps"] - steps_before
    del llm
    gc.collect()
    return {"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "num_steps": num_steps}


def run_transformers(model, requests, threads: int, batch_size: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    pad = model.config.pad_token_id or 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)  # a static batch runs until its longest request is done
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
    return {"seconds": time.perf_counter() - start, "output_tokens": sum(n for _, n in requests)}


def bench_family(name: str, config_name: str, fields: dict, requests, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        hf_model = build_checkpoint(Path(tmp), config_name, fields)
        num_params = sum(p.numel() for p in hf_model.parameters())
        runs: dict[str, list[dict]] = {"pagedserve": [], "transformers": []}
        for _ in range(args.rounds):  # alternating, so load from elsewhere falls on both
            runs["pagedserve"].append(run_pagedserve(Path(tmp), requests, args.threads))
            runs["transformers"].append(run_transformers(hf_model, requests, args.threads, args.hf_batch_size))
        del hf_model
        gc.collect()
    result = {"params_m": round(num_params / 1e6, 1)}
    for system, system_runs in runs.items():
        seconds = statistics.median(r["seconds"] for r in system_runs)
        result[system] = {"seconds": seconds, "tokens_per_s": system_runs[0]["output_tokens"] / seconds}
    result["ratio"] = result["pagedserve"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
    return result


def moe_vs_dense(requests, args) -> dict:
    """Mixtral's engine step time over the dense model's with the same active parameters: on the
    workload (mostly decode steps, where each step reads every expert some token picked) and on
    prefill steps alone (many tokens per expert)."""
    rng = random.Random(1)
    workloads = {"workload": requests,
                 "prefill": [([rng.randrange(3, 380) for _ in range(128)], 1) for _ in range(8)]}
    steps: dict[str, dict[str, list[float]]] = {label: {"moe": [], "dense": []} for label in workloads}
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as moe_dir, \
            tempfile.TemporaryDirectory(prefix="bench-dense-") as dense_dir:
        params_m = {}
        for kind, directory, (config_name, fields) in (("moe", moe_dir, CONFIGS["mixtral"]),
                                                        ("dense", dense_dir, DENSE_OF_MOE)):
            model = build_checkpoint(Path(directory), config_name, fields)
            params_m[kind] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
            del model
        for _ in range(args.rounds):
            for label, work in workloads.items():
                for kind, directory in (("moe", moe_dir), ("dense", dense_dir)):
                    run = run_pagedserve(Path(directory), work, args.threads)
                    steps[label][kind].append(run["seconds"] / run["num_steps"] * 1e3)
    out = {"params_m": params_m}
    for label, by_kind in steps.items():
        moe, dense = statistics.median(by_kind["moe"]), statistics.median(by_kind["dense"])
        out[label] = {"moe_step_ms": moe, "dense_step_ms": dense, "ratio": moe / dense}
        print(f"Mixtral ({params_m['moe']}M) {label} step {moe:.1f} ms vs dense of the same active "
              f"parameters ({params_m['dense']}M) {dense:.1f} ms: {moe / dense:.2f}x", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    # More requests than one static batch holds, outputs of mixed lengths: what continuous
    # batching is for (transformers runs each batch of 16 until its longest output is done).
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=32)
    parser.add_argument("--min-output", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    args = parser.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown families {unknown}: choose from {list(CONFIGS)}")
    requests = workload(args)
    print(f"{len(requests)} requests, {sum(n for _, n in requests)} output tokens, {args.threads} thread(s)")
    results = {}
    for name in families:
        config_name, fields = CONFIGS[name]
        results[name] = r = bench_family(name, config_name, fields, requests, args)
        print(f"{name:10s} {r['params_m']:6.1f}M params  pagedserve {r['pagedserve']['tokens_per_s']:7.1f} tok/s  "
              f"transformers {r['transformers']['tokens_per_s']:7.1f} tok/s  ratio {r['ratio']:.2f}x", flush=True)
        write_result("models", {"families": results, "args": vars(args)})  # a partial run keeps its lines
    summary = {"families": results, "args": vars(args)}
    if "mixtral" in families:
        summary["moe_vs_dense"] = moe_vs_dense(requests, args)
    ratios = [r["ratio"] for r in results.values()]
    if ratios:
        print(f"pagedserve / transformers: min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x")
    print("wrote", write_result("models", summary))


if __name__ == "__main__":
    main()
