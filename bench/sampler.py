"""What each sampling option costs a decode step: the Sampler on one step's logits (the default
model's vocabulary, bf16 as its lm_head gives them) for a batch of sequences that all ask for the
same options, against greedy sampling of the same batch, timed alternating in the same run.

    python -m bench.sampler [--rows 32] [--vocab 49152] [--threads 2] [--context 250]

The logits come from a peaked distribution (a few dozen likely tokens over a flat tail holding
~0.5 % of the mass, as a model's mostly are), so top_p decides from its first candidates as it
mostly does on real text (a flat distribution falls back to a sort of the row); each sequence has
--context tokens, a fifth of them generated. Writes bench/results/sampler.json.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import time_interleaved, write_result
from pagedserve.replicas.execution.sampler import Sampler
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.sequence import Sequence

OPTIONS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 1, top_p 0.95": dict(temperature=1.0, top_p=0.95),
    "top_k 50": dict(temperature=0.7, top_k=50),
    "min_p 0.05": dict(temperature=0.7, min_p=0.05),
    "repetition_penalty 1.1": dict(temperature=0.7, repetition_penalty=1.1),
    "presence_penalty 0.5": dict(temperature=0.7, presence_penalty=0.5),
    "frequency_penalty 0.5": dict(temperature=0.7, frequency_penalty=0.5),
    "logprobs 5": dict(temperature=0.7, logprobs=5),
    "seed": dict(temperature=0.7, seed=1),
}


def batch(args, params: dict) -> list[Sequence]:
    generated = args.context // 5
    seqs = []
    for i in range(args.rows):
        prompt = [(97 * (i + j)) % args.vocab for j in range(args.context - generated)]
        seq = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=args.context, **params), block_size=16)
        for j in range(generated):
            seq.append_token((31 * (i + 3 * j)) % args.vocab)
        seqs.append(seq)
    return seqs


def peaked_logits(rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) - 4
    likely = torch.randint(0, vocab, (rows, 40), generator=gen)
    logits.scatter_(1, likely, torch.rand(rows, 40, generator=gen) * 6 + 6)
    return logits.bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=250)
    parser.add_argument("--min-time", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = peaked_logits(args.rows, args.vocab)
    samplers = {name: (Sampler(args.vocab), batch(args, params)) for name, params in OPTIONS.items()}
    # The sampler may edit logits in place: each call gets a fresh copy (timed for all alike).
    times = time_interleaved({name: (lambda s=s, q=q: s(logits.clone(), q)) for name, (s, q) in samplers.items()},
                             min_time_s=args.min_time)
    print(f"Sampler on {args.rows} x {args.vocab} bf16 logits, {args.threads} thread(s); ms per step; "
          f"x greedy = time / greedy's")
    rows = []
    for name, seconds in times.items():
        ratio = seconds / times["greedy"]
        rows.append(dict(options=name, ms=seconds * 1e3, x_greedy=ratio))
        print(f"{name:30} {seconds * 1e3:8.2f} {ratio:8.2f}x")
    path = write_result("sampler", {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
