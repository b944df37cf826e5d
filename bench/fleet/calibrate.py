"""python -m bench.fleet.calibrate [--model DIR | --tiny] [--out FILE.json]

Fits the simulator's step-time model to the real engine on this CPU: a mixed stream of requests
(prompts of 16-512 tokens, 4-64 greedy tokens each, arriving in waves so prefill chunks and
decoding sequences mix) runs through `LLMEngine`; every step's duration is recorded next to what
it scheduled (prefill tokens, decoding sequences), and `cost_model.fit` turns the samples into the
JSON that `python -m bench.fleet --cost-model FILE.json` reads.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS_DIR, cpu_info
from bench.fleet.cost_model import CostModel, fit


def measure_steps(engine, num_requests: int, seed: int) -> list[tuple[int, int, float]]:
    """(prefill tokens, decoding sequences, seconds) of every non-empty step."""
    from pagedserve.replicas.core.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = min(engine.tokenizer.vocab_size, 30000)
    schedule = engine.scheduler.schedule
    scheduled = []

    def recording_schedule():
        out = schedule()
        scheduled.append(out)
        return out

    engine.scheduler.schedule = recording_schedule
    samples, added = [], 0
    while added < num_requests or engine.has_unfinished_requests():
        if added < num_requests and rng.random() < 0.3:  # a wave of new prompts joins the batch
            for _ in range(rng.randint(1, 4)):
                prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(16, 512))]
                engine.add_request(f"cal-{added}", prompt, SamplingParams(
                    max_tokens=rng.randint(4, 64), temperature=0.0, ignore_eos=True))
                added += 1
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        out = scheduled.pop() if scheduled else None
        if out is None or out.is_empty:
            continue
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.start < s.seq.num_prompt_tokens)
        decode = sum(1 for s in out.scheduled if s.start >= s.seq.num_prompt_tokens)
        samples.append((prefill, decode, elapsed))
    engine.scheduler.schedule = schedule
    return samples


def r_squared(model: CostModel, samples: list[tuple[int, int, float]]) -> float:
    mean = sum(t for _, _, t in samples) / len(samples)
    total = sum((t - mean) ** 2 for _, _, t in samples)
    residual = sum((t - model.step_time(p, d)) ** 2 for p, d, t in samples)
    return 1 - residual / total if total else 0.0


def main(argv=None) -> CostModel:
    p = argparse.ArgumentParser(prog="python -m bench.fleet.calibrate")
    p.add_argument("--model", default=None, help="a local HF directory; default: the embedded one")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (a quick check)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "fleet_cost_cpu.json")
    args = p.parse_args(argv)

    from pagedserve.replicas.config import EngineConfig
    from pagedserve.replicas.engine.llm_engine import LLMEngine

    model_dir = args.model
    if args.tiny:
        from tests.tiny_models import build_tiny_model
        model_dir = str(build_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama"))
    engine = LLMEngine(EngineConfig(model=model_dir, num_threads=args.threads, max_model_len=1024,
                                    num_kv_blocks=2048, max_num_seqs=32))
    measure_steps(engine, 4, args.seed + 1)  # warm-up: first-call costs are not steady state
    samples = measure_steps(engine, args.num_requests, args.seed)
    model = fit(samples, name=f"cpu:{Path(engine.model_dir).name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.to_json(args.out, num_samples=len(samples), r_squared=r_squared(model, samples),
                  model_dir=str(engine.model_dir), threads=args.threads, cpu=cpu_info())
    print(f"{model}  r^2 {r_squared(model, samples):.3f} over {len(samples)} steps -> {args.out}")
    return model


if __name__ == "__main__":
    main()
