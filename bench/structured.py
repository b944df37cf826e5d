"""Structured outputs: what grammar-constrained decoding costs.

1. Backends: llguidance (what the engine uses) and, where it is installed, xgrammar, on the same
   tokenizer and schemas: grammar compile ms per schema (each compile made unique so no cache
   answers it) and mask µs per token along a walk that picks a random allowed token each step.
2. Engine: one batch with half its requests JSON-schema-constrained against the same batch
   unconstrained, alternating rounds, median seconds; output tok/s ratio (goal >= 0.85) and the
   engine's own mask µs per constrained token. The schema's shortest output is longer than
   max_tokens, so both batches produce exactly the same number of tokens.

    python -m bench.structured [--model DIR] [--num-requests 16] [--max-tokens 64] [--rounds 3]
    python -m bench.structured --backends-only   # e.g. from a venv that also has xgrammar
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench.common import write_result

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
               "properties": {"name": {"type": "string", "maxLength": 20},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "tags": {"type": "array", "maxItems": 3,
                                       "items": {"enum": ["a", "b", "c"]}}}},
    "order": {"type": "object", "additionalProperties": False,
              "required": ["id", "items", "shipping", "status"],
              "properties": {
                  "id": {"type": "integer"},
                  "items": {"type": "array", "maxItems": 4, "items": {
                      "type": "object", "additionalProperties": False,
                      "required": ["sku", "qty", "price"],
                      "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                     "qty": {"type": "integer"}, "price": {"type": "number"}}}},
                  "shipping": {"type": "object", "additionalProperties": False,
                               "required": ["city", "zip", "express"],
                               "properties": {"city": {"type": "string"},
                                              "zip": {"type": "string", "maxLength": 10},
                                              "express": {"type": "boolean"}}},
                  "status": {"enum": ["new", "paid", "shipped"]}}},
    "tool_call": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": f"tool_{i}"}, "arguments": {
             "type": "object", "additionalProperties": False, "required": ["query", "limit"],
             "properties": {"query": {"type": "string"},
                            "limit": {"type": "integer", "minimum": 1, "maximum": 50}}}}}
        for i in range(8)]}},
    "any_object": {"type": "object"},
}
# Shortest output well over 64 tokens: every constrained request runs to max_tokens.
LONG_SCHEMA = {"type": "object", "additionalProperties": False,
               "required": ["id", "name", "tags", "scores"],
               "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                              "name": {"type": "string", "maxLength": 24},
                              "tags": {"type": "array", "minItems": 6, "maxItems": 6,
                                       "items": {"enum": ["new", "sale", "eco", "hot"]}},
                              "scores": {"type": "array", "minItems": 40, "maxItems": 40,
                                         "items": {"type": "integer", "minimum": 0,
                                                   "maximum": 99}}}}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _allowed(bitmask_row, vocab_size: int, rng: random.Random) -> int | None:
    import numpy as np
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    allowed = np.flatnonzero(bits)
    return int(allowed[rng.randrange(len(allowed))]) if len(allowed) else None


def _walk(fill, consume, done, bitmask, vocab_size: int, max_steps: int = 150) -> list[float]:
    rng, times = random.Random(0), []
    for _ in range(max_steps):
        if done():
            break
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        token = _allowed(bitmask[0], vocab_size, rng)
        if token is None or not consume(token):
            break
    return times


def bench_llguidance(tokenizer, vocab_size: int, num_compiles: int) -> dict:
    import llguidance
    import llguidance.hf
    import torch

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    result = {"tokenizer_s": time.perf_counter() - start, "schemas": {}}
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for name, schema in SCHEMAS.items():
        compiles = []
        for i in range(num_compiles):
            unique = {**schema, "description": f"run {i}"}
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
                unique, overrides=JSON_OPTIONS), log_level=0)
            compiles.append(time.perf_counter() - start)
            assert not matcher.is_error(), matcher.get_error()
        masks = _walk(lambda: matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4),
                      matcher.consume_token, matcher.is_stopped, bitmask, vocab_size)
        result["schemas"][name] = _summary(compiles, masks)
    return result


def bench_xgrammar(tokenizer, vocab_size: int, num_compiles: int) -> dict | None:
    try:
        import xgrammar
    except ImportError:
        return None
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    result = {"tokenizer_s": time.perf_counter() - start, "schemas": {}}
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    for name, schema in SCHEMAS.items():
        compiles = []
        for i in range(num_compiles):
            unique = {**schema, "description": f"run {i}"}
            start = time.perf_counter()
            matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(
                json.dumps(unique), any_whitespace=False))
            compiles.append(time.perf_counter() - start)
        masks = _walk(lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token,
                      matcher.is_terminated, bitmask, vocab_size)
        result["schemas"][name] = _summary(compiles, masks)
    return result


def _summary(compiles: list[float], masks: list[float]) -> dict:
    return {"compile_ms_median": round(statistics.median(compiles) * 1e3, 3),
            "compile_ms_first": round(compiles[0] * 1e3, 3),
            "mask_us_median": round(statistics.median(masks) * 1e6, 2) if masks else None,
            "mask_us_mean": round(statistics.mean(masks) * 1e6, 2) if masks else None,
            "mask_steps": len(masks)}


def bench_engine(model: str | None, num_requests: int, max_tokens: int, rounds: int,
                 num_threads: int | None) -> dict:
    from pagedserve import LLM, SamplingParams
    from pagedserve.replicas.core.sampling_params import StructuredOutputsParams
    from pagedserve.replicas.structured.bitmask import TokenBitmask

    mask_time = [0.0, 0]
    real_apply = TokenBitmask.apply

    def timed_apply(self, logits, rows, matchers):
        start = time.perf_counter()
        real_apply(self, logits, rows, matchers)
        mask_time[0] += time.perf_counter() - start
        mask_time[1] += len(rows)

    TokenBitmask.apply = timed_apply
    kwargs = {"num_threads": num_threads} if num_threads else {}
    llm = LLM(model, max_model_len=1024, **kwargs)
    prompts = [f"Request {i}: describe item number {i} as JSON." for i in range(num_requests)]
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=max_tokens, ignore_eos=True)
    constrained = free.clone(structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA))
    batches = {"none_constrained": [free] * num_requests,
               "half_constrained": [constrained if i % 2 else free for i in range(num_requests)]}
    llm.generate(prompts[:2], [free, constrained], use_tqdm=False)  # warm-up, grammar compiled
    seconds: dict[str, list[float]] = {name: [] for name in batches}
    # CPU seconds of this process (every thread): steadier than wall time on shared cores.
    cpu_seconds: dict[str, list[float]] = {name: [] for name in batches}
    tokens: dict[str, int] = {}
    for _ in range(rounds):
        for name, params in batches.items():
            mask_time[:] = [0.0, 0]
            start, cpu_start = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.process_time() - cpu_start)
            print(f"  {name}: {seconds[name][-1]:.2f} s wall, {cpu_seconds[name][-1]:.2f} s cpu",
                  flush=True)
            tokens[name] = sum(len(c.token_ids) for o in outs for c in o.outputs)
            if name == "half_constrained":
                mask_us = mask_time[0] / max(mask_time[1], 1) * 1e6
    TokenBitmask.apply = real_apply
    tok_s = {name: tokens[name] / statistics.median(s) for name, s in seconds.items()}
    tok_cpu_s = {name: tokens[name] / statistics.median(s) for name, s in cpu_seconds.items()}
    return {"model": llm.llm_engine.model_name, "num_requests": num_requests,
            "max_tokens": max_tokens, "rounds": rounds, "seconds": seconds, "tokens": tokens,
            "cpu_seconds": cpu_seconds,
            "output_tok_s": {k: round(v, 1) for k, v in tok_s.items()},
            "ratio_half_vs_none": round(tok_s["half_constrained"] / tok_s["none_constrained"], 3),
            "ratio_half_vs_none_cpu_time": round(tok_cpu_s["half_constrained"]
                                                 / tok_cpu_s["none_constrained"], 3),
            "engine_mask_us_per_constrained_token": round(mask_us, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded model)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-compiles", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--backends-only", action="store_true")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from pagedserve.replicas.model_files.default_model import resolve_model
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    result = {"backends": {"llguidance": bench_llguidance(tokenizer, vocab_size, args.num_compiles)}}
    xgrammar_result = bench_xgrammar(tokenizer, vocab_size, args.num_compiles)
    if xgrammar_result is not None:
        result["backends"]["xgrammar"] = xgrammar_result
    for backend, numbers in result["backends"].items():
        for schema, s in numbers["schemas"].items():
            print(f"{backend:>10} {schema:>10}: compile {s['compile_ms_median']:8.2f} ms, "
                  f"mask {s['mask_us_median']} us/token median ({s['mask_us_mean']} mean)")
    if not args.backends_only:
        engine = bench_engine(args.model, args.num_requests, args.max_tokens, args.rounds,
                              args.num_threads)
        result["engine"] = engine
        print(f"engine ({engine['model']}): none constrained "
              f"{engine['output_tok_s']['none_constrained']} tok/s, half constrained "
              f"{engine['output_tok_s']['half_constrained']} tok/s, ratio "
              f"{engine['ratio_half_vs_none']} (goal >= 0.85; by CPU time "
              f"{engine['ratio_half_vs_none_cpu_time']}); mask "
              f"{engine['engine_mask_us_per_constrained_token']} us per constrained token")
    name = "structured_backends" if args.backends_only else "structured"
    print(f"wrote {write_result(name, result)}")


if __name__ == "__main__":
    main()
