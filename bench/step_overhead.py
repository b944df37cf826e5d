"""Per-step host overhead of the model runner: everything but the model's forward.

ModelRunner.execute() runs with the model swapped for a stub that returns zeros of the right
shapes, so what is timed is building the inputs and attention metadata plus the sampler's
bookkeeping. The runner's persistent InputBatch is timed against the per-step list builder it
replaced (kept below as the baseline), on the same scheduler outputs, alternating which goes
first, at 1, 16, 64 and 256 running decode sequences; InputBatch.prepare() alone is timed too.
Prints medians and ratios, writes JSON.

    python -m bench.step_overhead [--steps 200] [--prompt-len 128]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from bench.common import write_result
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.replicas.core.block_manager import BlockManager
from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.execution.model_runner import ModelRunner, RunnerOutput
from pagedserve.replicas.execution.sampler import compute_prompt_logprobs
from pagedserve.replicas.core.sampling_params import SamplingParams
from pagedserve.replicas.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.replicas.core.sequence import Sequence
from tests.tiny_models import build_tiny_model

BATCH_SIZES = (1, 16, 64, 256)


class ZeroModel:
    """Stands in for the model: zeros of the shapes the runner expects, and the last inputs."""

    def __init__(self, hidden_size: int, vocab_size: int):
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.last_inputs = None

    def __call__(self, input_ids, positions, kv_caches, metadata):
        self.last_inputs = (input_ids, positions, metadata)
        return torch.zeros(input_ids.shape[0], self.hidden_size)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab_size)


@torch.inference_mode()
def _list_execute(runner: ModelRunner, out: SchedulerOutput) -> RunnerOutput:
    """The baseline: ModelRunner.execute as it was, rebuilding lists and tensors every step."""
    input_ids, positions, slots = [], [], []
    query_lens, seq_lens, block_tables = [], [], []
    logits_rows, sampling_seqs = [], []
    prompt_rows = []
    bs = runner.block_size
    row = 0
    for item in out.scheduled:
        seq, start, n = item.seq, item.start, item.num_new_tokens
        end = start + n
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        query_lens.append(n)
        seq_lens.append(end)
        block_tables.append(table)
        if (seq.sampling_params.prompt_logprobs is not None and seq.index == 0
                and start < seq.num_prompt_tokens - 1):
            last = min(end, seq.num_prompt_tokens - 1)
            prompt_rows.append((seq, start, row, last - start, seq.token_ids[start + 1:last + 1]))
        row += n
        if item.samples:
            logits_rows.append(row - 1)
            sampling_seqs.append(seq)
    dev = runner.device
    width = max(len(t) for t in block_tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                  dtype=torch.int32, device=dev),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, query_start_loc_cpu=starts)
    hidden = runner.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                          torch.tensor(positions, dtype=torch.int64, device=dev),
                          runner.kv_caches, metadata)
    prompt_logprobs = {}
    for seq, start, first, count, next_ids in prompt_rows:
        logits = runner.model.compute_logits(hidden[first:first + count])
        prompt_logprobs[seq.seq_id] = (start, compute_prompt_logprobs(
            logits, next_ids, seq.sampling_params.prompt_logprobs))
    if not sampling_seqs:
        return RunnerOutput([], [], prompt_logprobs)
    logits = runner.model.compute_logits(hidden[torch.tensor(logits_rows, device=dev)])
    sampled = runner.sampler(logits, sampling_seqs)
    return RunnerOutput([[t] for t in sampled.sampled_token_ids],
                        [None if p is None else [p] for p in sampled.logprobs], prompt_logprobs)


def _same_inputs(a, b) -> bool:
    (ids_a, pos_a, m_a), (ids_b, pos_b, m_b) = a, b
    tensors = [(ids_a, ids_b), (pos_a, pos_b)] + [
        (getattr(m_a, f), getattr(m_b, f))
        for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")]
    return (all(x.dtype == y.dtype and torch.equal(x, y) for x, y in tensors)
            and m_a.query_lens_cpu == m_b.query_lens_cpu and m_a.seq_lens_cpu == m_b.seq_lens_cpu)


def measure(model_dir: str, num_seqs: int, args) -> dict:
    block_size = 16
    max_len = args.prompt_len + args.steps + 64  # + the tokens decoded while others prefill
    num_blocks = num_seqs * -(-max_len // block_size) + 8
    config = EngineConfig(model=model_dir, device="cpu", num_threads=1, block_size=block_size,
                          max_num_seqs=num_seqs, max_num_batched_tokens=max(1024, num_seqs),
                          num_kv_blocks=num_blocks)
    runner = ModelRunner(config, model_dir)
    runner.model = model = ZeroModel(runner.hf_config.hidden_size, runner.vocab_size)
    scheduler = Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False),
                          num_seqs, config.max_num_batched_tokens, max_model_len=max_len)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [3 + (i + j) % 300 for j in range(args.prompt_len)]
        scheduler.add(Sequence(str(i), prompt, params, block_size))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in scheduler.running) or scheduler.waiting:
        out = scheduler.schedule()  # prefill: not timed
        scheduler.update(out, runner.execute(out).sampled_token_ids)

    paths = {"list": lambda out: _list_execute(runner, out), "input_batch": runner.execute}
    times = {name: [] for name in (*paths, "prepare")}
    for step in range(args.steps):
        out = scheduler.schedule()
        assert len(out.scheduled) == num_seqs and out.num_batched_tokens == num_seqs
        inputs, results = {}, {}
        for name in (paths if step % 2 == 0 else reversed(paths)):
            start = time.perf_counter()
            results[name] = paths[name](out)
            times[name].append(time.perf_counter() - start)
            inputs[name] = model.last_inputs
        # The input-building part alone, again on the same step: nothing new to append by now.
        start = time.perf_counter()
        runner.input_batch.prepare(out.scheduled)
        times["prepare"].append(time.perf_counter() - start)
        if step == 0 and not _same_inputs(inputs["list"], inputs["input_batch"]):
            raise AssertionError("the two paths built different model inputs")
        scheduler.update(out, results["input_batch"].sampled_token_ids)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    best = {name: min(t) * 1e3 for name, t in times.items()}
    return {"num_seqs": num_seqs, "list_ms": median["list"], "input_batch_ms": median["input_batch"],
            "prepare_ms": median["prepare"], "ratio": median["list"] / median["input_batch"],
            "list_best_ms": best["list"], "input_batch_best_ms": best["input_batch"],
            "best_ratio": best["list"] / best["input_batch"],
            "input_batch_us_per_seq": median["input_batch"] * 1e3 / num_seqs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp))
        rows = [measure(model_dir, n, args) for n in BATCH_SIZES]
    print("medians over steps; 'prepare' is the input batch's share; 'best' is the ratio of minima")
    print(f"{'seqs':>5} {'list ms':>9} {'batch ms':>9} {'prepare':>9} {'ratio':>7} {'best':>7} {'us/seq':>7}")
    for r in rows:
        print(f"{r['num_seqs']:>5} {r['list_ms']:>9.3f} {r['input_batch_ms']:>9.3f} {r['prepare_ms']:>9.3f} "
              f"{r['ratio']:>6.2f}x {r['best_ratio']:>6.2f}x {r['input_batch_us_per_seq']:>7.2f}")
    by_size = {r["num_seqs"]: r for r in rows}
    growth = by_size[256]["input_batch_ms"] / by_size[64]["input_batch_ms"]
    print(f"input batch, 256 vs 64 sequences: {growth:.2f}x the time for 4x the sequences")
    path = write_result("step_overhead", {"steps": args.steps, "prompt_len": args.prompt_len,
                                          "results": rows, "growth_256_over_64": growth})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
