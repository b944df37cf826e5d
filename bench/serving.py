"""Served throughput and latency: pagedserve (`serve run`, 1 replica) vs vLLM's OpenAI server.

Both serve the same model directory at the same dtype and thread count, one server at a time, and
each is driven by the same `vllm bench serve` run (from the vLLM environment, bench/peers/setup_vllm.sh):
random prompts, `ignore_eos`, streamed chat completions, at each point of a sweep of request rates
(incl. inf) and of client concurrency (at rate inf). Prints request and output-token throughput,
TTFT / TPOT / ITL p50 and p99, and pagedserve / vLLM ratios; writes bench/results/serving.json and
serving.png. Each point also gets its model FLOP/s (bench.peers.offline.model_flops over the
prompt and output lengths the load generator counted) and MFU against the best large torch.mm at
the same threads and dtype, measured at the start: where a server already runs near that peak,
no serving-path change can raise its throughput.

    python -m bench.serving [--model DIR|tiny] [--threads 1] [--replicas 1] [--engine-threads N] [--num-prompts 32] [--input-len 128] [--output-len 64]
                            [--request-rates 1,4,inf] [--concurrency 1,8,32] [--systems pagedserve,vllm]
                            [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from bench import cpu_level
from bench.common import RESULTS_DIR, free_port, write_result
from bench.peers.offline import gemm_peak_in_child, model_flops_of_lengths
from bench.peers.vllm_env import vllm_environ, vllm_python

ROOT = Path(__file__).resolve().parent.parent
BENCH_SERVE = Path(__file__).resolve().parent / "peers" / "vllm_bench_serve.py"
METRICS = ("ttft", "tpot", "itl")
PERCENTILES = ("50", "99")


class FlopBasis(NamedTuple):
    """What a point's model FLOP/s and MFU are computed from."""
    hf_config: dict
    peak_gflops_per_s: float  # the best large torch.mm at the servers' threads and dtype


def flop_basis(args, model_dir: str) -> FlopBasis | None:
    """The model's config and the GEMM peak, measured now; None for a model without a
    config.json (a GGUF file)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    return FlopBasis(json.loads(config.read_text()), gemm_peak_in_child(args.threads, args.dtype))


class Server:
    """One server process group on 127.0.0.1:port; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_path: Path, cwd: Path = ROOT,
                 scratch: Path | None = None):
        self.name, self.cmd, self.env, self.port, self.cwd = name, cmd, env, port, cwd
        self.log_path = log_path
        self.scratch = scratch  # removed once the server has stopped
        self.base_url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "Server":
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float) -> str:
        """Waits for GET /v1/models to answer; returns the served model id."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=5) as response:
                    return json.load(response)["data"][0]["id"]
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            # SIGTERM to the group: `serve run` tears its Ray instance down, vLLM its engine processes.
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def pagedserve_server(args, model_dir: str, port: int, workdir: Path) -> Server:
    """`serve run serve_app:app key=value ...`, as the README serves."""
    settings = {"model": model_dir, "dtype": args.dtype, "num_replicas": args.replicas,
                "num_threads": args.engine_threads or args.threads // args.replicas,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "kv_cache_memory_gb": args.kv_cache_gb, "host": "127.0.0.1", "port": port,
                "direct_http": args.pagedserve_http == "direct"}
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # A Ray instance of its own: a private temp dir hides any cluster started with `ray start`.
    # A short one: Ray's Unix sockets live under it, and a path past their 107-byte limit (the
    # benchmark's own work dir was) costs the start a minute (the dashboard fails after a wait).
    ray_dir = Path(tempfile.mkdtemp(prefix="psray-"))
    env.update(RAY_TMPDIR=str(ray_dir), RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    serve = Path(sys.executable).parent / "serve"
    return Server("pagedserve", [str(serve), "run", "serve_app:app",
                                 *(f"{key}={value}" for key, value in settings.items())],
                  env, port, workdir / "pagedserve.log", scratch=ray_dir)


def vllm_server(args, model_dir: str, port: int, workdir: Path) -> Server:
    cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--seed", str(args.seed), "--disable-log-stats", "--disable-uvicorn-access-log"]
    return Server("vllm", cmd, vllm_environ(args.threads, args.kv_cache_gb), port, workdir / "vllm.log")


def sweep_points(args) -> list[tuple[str, int | None]]:
    """(request rate, max concurrency): the rate sweep uncapped, then concurrency at rate inf."""
    points = [(rate, None) for rate in args.request_rates.split(",") if rate]
    points += [("inf", int(c)) for c in args.concurrency.split(",") if c]
    return points


def point_label(rate: str, concurrency: int | None) -> str:
    return f"rate {rate}" if concurrency is None else f"conc {concurrency}"


def bench_serve(args, server: Server, model_id: str, model_dir: str, rate: str, concurrency: int | None,
                workdir: Path, extra_args: tuple[str, ...] = ()) -> dict:
    """One `vllm bench serve` run against `server` (`extra_args` appended to its command line);
    its saved result JSON."""
    num_prompts = args.num_prompts
    if concurrency is not None:  # enough requests to fill the concurrency, not more than needed
        num_prompts = max(min(args.num_prompts, 8 * concurrency), 2 * concurrency)
    name = f"{server.name}-{point_label(rate, concurrency).replace(' ', '-')}.json"
    cmd = [str(vllm_python()), str(BENCH_SERVE), "--backend", args.backend, "--base-url", server.base_url,
           "--endpoint", "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions",
           "--model", model_id, "--tokenizer", model_dir, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(num_prompts), "--request-rate", rate, "--ignore-eos",
           "--seed", str(args.seed), "--num-warmups", str(args.num_warmups), "--disable-tqdm",
           "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(PERCENTILES),
           "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", name]
    if concurrency is not None:
        cmd += ["--max-concurrency", str(concurrency)]
    cmd += list(extra_args)
    # The client gets no core binding: it is the same process for both servers.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    log = workdir / (name + ".log")
    with open(log, "w") as f:
        finished = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.point_timeout_s)
    if finished.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed on {server.name}:\n{log.read_text()[-4000:]}")
    return json.loads((workdir / name).read_text())


def summarize(raw: dict, flops: FlopBasis | None = None) -> dict:
    """The figures kept of one `vllm bench serve` result (its per-request lists dropped)."""
    keep = {"completed": raw.get("completed"), "failed": raw.get("failed", 0),
            "request_throughput": raw["request_throughput"], "output_throughput": raw["output_throughput"],
            "duration_s": raw["duration"], "num_prompts": raw["num_prompts"],
            "total_input_tokens": raw.get("total_input_tokens"),
            "total_output_tokens": raw.get("total_output_tokens")}
    for metric in METRICS:
        for p in PERCENTILES:
            keep[f"p{p}_{metric}_ms"] = raw.get(f"p{p}_{metric}_ms")
    if flops is not None and raw.get("input_lens"):
        # The prompt lengths are the server's own counts (usage), chat template included; a
        # failed request generated nothing and is left out. Prefix-cache hits count as computed.
        lengths = [(i, o) for i, o in zip(raw["input_lens"], raw["output_lens"]) if o]
        gflops = model_flops_of_lengths(flops.hf_config, lengths) / raw["duration"] / 1e9
        keep["model_gflops_per_s"] = gflops
        keep["mfu"] = gflops / flops.peak_gflops_per_s
    return keep


def run_system(args, system: str, model_dir: str, workdir: Path, flops: FlopBasis | None = None) -> dict:
    make = {"pagedserve": pagedserve_server, "vllm": vllm_server}[system]
    return run_points(args, make(args, model_dir, free_port(), workdir), model_dir, workdir,
                      flops=flops)


def run_points(args, server: Server, tokenizer: str, workdir: Path, extra_args: tuple[str, ...] = (),
               flops: FlopBasis | None = None) -> dict:
    """Start `server`, then every sweep point of `args` against it, printed as it goes; the
    summaries by point label. `tokenizer` is the load generator's (an HF folder)."""
    results = {}
    with server:
        began = time.monotonic()
        model_id = server.wait_ready(args.startup_timeout_s)
        print(f"{server.name}: ready in {time.monotonic() - began:.0f} s on port {server.port} "
              f"(model {model_id!r})", flush=True)
        for rate, concurrency in sweep_points(args):
            label = point_label(rate, concurrency)
            results[label] = summarize(bench_serve(args, server, model_id, tokenizer, rate, concurrency,
                                                   workdir, extra_args), flops)
            r = results[label]
            mfu = f"  MFU {r['mfu']:6.1%}" if "mfu" in r else ""
            print(f"  {label:>9}: {r['request_throughput']:6.2f} req/s {r['output_throughput']:8.1f} out tok/s  "
                  f"TTFT p50 {r['p50_ttft_ms']:8.1f} p99 {r['p99_ttft_ms']:8.1f}  "
                  f"TPOT p50 {r['p50_tpot_ms']:7.1f}  ITL p50 {r['p50_itl_ms']:7.1f} "
                  f"p99 {r['p99_itl_ms']:7.1f} ms  failed {r['failed']} of {r['num_prompts']}{mfu}",
                  flush=True)
    return results


def median_results(rounds: list[dict]) -> dict:
    """Per sweep point, the median of each figure over the rounds (failures summed)."""
    merged = {}
    for label in rounds[0]:
        point = merged[label] = {}
        for key in rounds[0][label]:
            values = [r[label][key] for r in rounds]
            if key == "failed":
                point[key] = sum(values)
            elif all(isinstance(v, (int, float)) for v in values):
                point[key] = statistics.median(values)
            else:
                point[key] = values[0]
    return merged


def ratio_table(results: dict, base: str = "vllm", ours: str = "pagedserve") -> dict:
    """ours / base per sweep point: throughputs (higher is better) and latencies (lower is better)."""
    ratios = {}
    print(f"\n{ours} / {base} (throughput: >1 is better; latency: <1 is better); rejected/failed "
          f"requests: {ours} {sum(r['failed'] for r in results[ours].values())}, {base} "
          f"{sum(r['failed'] for r in results[base].values())}")
    print(f"{'point':>9} " + " ".join(f"{h:>8}" for h in
                                       ("req/s", "tok/s", "TTFTp50", "TTFTp99", "TPOTp50", "TPOTp99", "ITLp50", "ITLp99")))
    keys = ["request_throughput", "output_throughput"] + [f"p{p}_{m}_ms" for m in METRICS for p in PERCENTILES]
    for label in results[ours]:
        a, b = results[ours][label], results[base].get(label)
        if b is None:
            continue
        ratios[label] = {k: (a[k] / b[k] if a.get(k) and b.get(k) else None) for k in keys}
        mfu = (f"   MFU {a['mfu']:.1%} vs {b['mfu']:.1%}" if "mfu" in a and "mfu" in b else "")
        print(f"{label:>9} " + " ".join(f"{ratios[label][k]:7.2f}x" if ratios[label][k] is not None
                                        else f"{'n/a':>8}" for k in keys) + mfu)
    return ratios


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return None
    systems = list(results)
    labels = list(next(iter(results.values())))
    panels = [("output_throughput", "output tokens/s"), ("p50_ttft_ms", "TTFT p50 (ms)"),
              ("p99_ttft_ms", "TTFT p99 (ms)"), ("p50_tpot_ms", "TPOT p50 (ms)"), ("p99_itl_ms", "ITL p99 (ms)"),
              ("request_throughput", "requests/s")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    width = 0.8 / len(systems)
    for ax, (key, title) in zip(axes.flat, panels):
        for i, system in enumerate(systems):
            values = [results[system].get(label, {}).get(key) or 0 for label in labels]
            ax.bar([x + i * width for x in range(len(labels))], values, width, label=system)
        ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(labels))], labels, rotation=30)
        ax.set_title(title)
    axes.flat[0].legend()
    fig.suptitle("pagedserve vs vLLM-CPU, same model, dtype, threads and load generator")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="HF directory, or 'tiny' (bench.serving_overhead's 3-layer model); "
                             "default: the embedded model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads / cores for each server")
    parser.add_argument("--replicas", type=int, default=1,
                        help="pagedserve engine replicas, sharing --threads between them")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="pagedserve's torch threads per replica (default: --threads / "
                             "--replicas); fewer leave the rest of the cores to its serving "
                             "processes, off the engine's CPUs (cpu_bind=auto)")
    parser.add_argument("--systems", default="pagedserve,vllm")
    parser.add_argument("--pagedserve-http", choices=("direct", "proxy"), default="direct",
                        help="pagedserve's HTTP from its ingress replicas, or Ray Serve's proxy")
    parser.add_argument("--backend", default="openai-chat", choices=["openai-chat", "openai"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-warmups", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rates", default="1,4,inf")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each system, alternating; medians are reported")
    cpu_level.add_argument(parser)
    parser.add_argument("--startup-timeout-s", type=float, default=600)
    parser.add_argument("--point-timeout-s", type=float, default=900)
    args = parser.parse_args()
    cpu_level.apply(args.cpu_level)

    if args.replicas < 1 or args.threads % args.replicas:
        parser.error("--threads must be a multiple of --replicas")
    if args.engine_threads is not None and not 1 <= args.engine_threads * args.replicas <= args.threads:
        parser.error("--engine-threads x --replicas must be between 1 and --threads")
    from pagedserve.replicas.model_files.default_model import resolve_model
    if args.model == "tiny":
        from bench.serving_overhead import build_tiny
        model_dir = build_tiny(tempfile.mkdtemp(prefix="bench-serving-tiny-"))
    else:
        model_dir = resolve_model(args.model)
    systems = [s for s in args.systems.split(",") if s]
    flops = flop_basis(args, model_dir)
    if flops is not None:
        print(f"{args.dtype} GEMM peak at {args.threads} thread(s): "
              f"{flops.peak_gflops_per_s:.1f} GFLOP/s (torch.mm)", flush=True)
    rounds: dict[str, list[dict]] = {system: [] for system in systems}
    with tempfile.TemporaryDirectory(prefix="psbench-") as tmp:
        for round_ in range(args.rounds):  # alternating, so drift on a shared machine hits both
            for system in systems:
                workdir = Path(tmp) / f"{system}-{round_}"
                workdir.mkdir()
                rounds[system].append(run_system(args, system, model_dir, workdir, flops))
    results = {system: median_results(r) for system, r in rounds.items()}
    summary = {"config": vars(args), "model_dir": model_dir, "results": results, "rounds": rounds,
               "gemm_peak_gflops_per_s": flops.peak_gflops_per_s if flops else None}
    if "pagedserve" in results and "vllm" in results:
        summary["ratios_pagedserve_over_vllm"] = ratio_table(results)
    print("wrote", write_result("serving", summary))
    png = plot(results, RESULTS_DIR / "serving.png")
    if png:
        print("wrote", png)


if __name__ == "__main__":
    main()
