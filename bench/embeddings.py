"""Embeddings throughput: /v1/embeddings against sentence-transformers' encode, same texts, same run.

The same seeded texts (5 to 120 words, so a batch mixes lengths) are split into batches of B
(`--batch-size`) and embedded four ways, in alternating rounds, all on `--threads` torch threads:

- `st_per_batch` (the baseline): sentence-transformers `encode(batch)` for each batch of B, as a
  server handling one request of B texts at a time would; it pads each batch to its longest text.
- `st_sorted`: one `encode(all texts, batch_size=B)`, which sorts all the texts by length first
  (padding little), an offline luxury a server of separate requests does not have.
- `offline`: `LLM.embed` per batch of B in this process (our padding-free encoder alone).
- `served`: POST /v1/embeddings, one request per batch of B, `--concurrency` in flight, to a Ray
  Serve app started here (proxy -> ingress -> one encoder replica), base64-encoded as the OpenAI
  SDK asks by default (`--encoding float` for JSON floats).

All four run in `--dtype` (sentence-transformers loads its model in it too); the cosines are
against a float32 sentence-transformers encode, whatever the dtype.

Prints texts/s (median of the rounds) and the ratios against `st_per_batch` (goal for `served`:
>= 1.5x at batch 32) and against `st_sorted`; writes JSON.

    python -m bench.embeddings [--model all-MiniLM-L6-v2|DIR] [--threads 1] [--batch-size 32]
                               [--num-texts 256] [--rounds 3] [--concurrency 2] [--encoding base64]
                               [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import base64
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.common import free_port, write_result

WORDS = ("the of and to in is that for it as with was on be by at this from or an are not have "
         "but which one all were we when there can been has more if will would who so no model "
         "server cache block attention replica request token batch vector memory kernel route "
         "embedding sentence language transformer engine queue prefix scheduler latency").split()


def cpu_description() -> str:
    from pagedserve.kernels import cpu_features
    flags = cpu_features.cpu_flags()
    shown = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if flag in flags]
    return f"{cpu_features.cpu_name()} ({', '.join(shown) or 'no avx2'})"


def make_texts(num_texts: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))).capitalize() + "."
            for _ in range(num_texts)]


def serve_app(model: str, threads: int, dtype: str):
    import ray
    from ray import serve

    from pagedserve.serve_app import build_app
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(dict(model=model, num_replicas=1, num_threads=threads,
                             replica_num_cpus=1, dtype=dtype)), name="embeddings", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def served_embed(client, texts: list[str], batch_size: int, concurrency: int,
                 encoding: str) -> np.ndarray:
    batches = [texts[i:i + batch_size] for i in range(0, len(texts), batch_size)]

    def post(batch):
        response = client.post("/v1/embeddings", json={"input": batch, "encoding_format": encoding})
        response.raise_for_status()
        data = [d["embedding"] for d in response.json()["data"]]
        if encoding == "base64":  # as the OpenAI SDK decodes it
            return [np.frombuffer(base64.b64decode(e), dtype="<f4") for e in data]
        return data

    with ThreadPoolExecutor(concurrency) as pool:
        return np.array([row for rows in pool.map(post, batches) for row in rows], np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--encoding", choices=["base64", "float"], default="base64",
                        help="encoding_format of the served calls (the OpenAI SDK's default: base64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="of every system here, sentence-transformers included")
    args = parser.parse_args()

    import httpx
    import torch
    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM
    from pagedserve.replicas.model_files.embedding_model import resolve_model_name

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_name(args.model)
    torch_dtype = getattr(torch, args.dtype)
    exact = SentenceTransformer(model_dir, device="cpu")  # float32: what the cosines are against
    reference = (exact if args.dtype == "float32" else
                 SentenceTransformer(model_dir, device="cpu", model_kwargs={"dtype": torch_dtype}))
    offline = LLM(args.model, num_threads=args.threads, dtype=args.dtype)
    base_url = serve_app(args.model, args.threads, args.dtype)
    client = httpx.Client(base_url=base_url, timeout=300)
    num_tokens = sum(len(ids) for ids in reference.tokenizer(make_texts(args.num_texts, args.seed))
                     ["input_ids"])

    def per_batch(embed):
        return lambda texts: np.concatenate([embed(texts[i:i + args.batch_size])
                                             for i in range(0, len(texts), args.batch_size)])

    runs = {
        "st_per_batch": per_batch(lambda batch: reference.encode(
            batch, batch_size=args.batch_size, convert_to_numpy=True)),
        "st_sorted": lambda texts: reference.encode(texts, batch_size=args.batch_size,
                                                    convert_to_numpy=True),
        "offline": per_batch(lambda batch: np.array(
            [o.outputs.embedding for o in offline.embed(batch, use_tqdm=False)], np.float32)),
        "served": lambda texts: served_embed(client, texts, args.batch_size, args.concurrency,
                                             args.encoding),
    }
    texts = make_texts(args.num_texts, args.seed)
    for run in runs.values():  # warm-up (and the served replica's first batches)
        run(texts[:args.batch_size])
    rates: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            results[name] = run(texts)
            rates[name].append(len(texts) / (time.perf_counter() - start))
    expected = exact.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
    cosines = {name: float(((got * expected).sum(1) / (np.linalg.norm(got, axis=1)
                                                       * np.linalg.norm(expected, axis=1))).min())
               for name, got in results.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    baseline, sorted_baseline = medians["st_per_batch"], medians["st_sorted"]
    cpu = cpu_description()
    # The machine may be shared: its load says how far to trust the absolute figures.
    load = [round(x, 2) for x in os.getloadavg()]
    print(f"{args.num_texts} texts ({num_tokens} tokens), batch {args.batch_size}, {args.dtype}, "
          f"{args.threads} thread(s), {args.rounds} alternating rounds, {cpu}, "
          f"load average {load[0]} {load[1]} {load[2]}")
    print(f"{'':14} {'texts/s':>9} {'vs st_per_batch':>16} {'vs st_sorted':>13}  min cosine vs fp32")
    for name, rate in medians.items():
        print(f"{name:14} {rate:9.1f} {rate / baseline:15.2f}x {rate / sorted_baseline:12.2f}x  "
              f"{cosines[name]:.6f}")
    path = write_result("embeddings", dict(
        args=vars(args), cpu=cpu, load_average=load, num_tokens=num_tokens, texts_per_s=rates,
        median=medians,
        ratio={name: rate / baseline for name, rate in medians.items()},
        ratio_vs_sorted={name: rate / sorted_baseline for name, rate in medians.items()},
        min_cosine=cosines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
