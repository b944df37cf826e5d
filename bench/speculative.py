"""Speculative decoding against plain decoding, measured in the same run, on the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF, default dtype).

    python -m bench.speculative                      # ngram, k=4, lookup 2..4; every part
    python -m bench.speculative --k 8 --lookup 3,5 --rounds 5 --parts batch1
    python -m bench.speculative --quick              # smoke run: short outputs, 1 round

Two engines, built once: plain, and one with speculative_config {"method": "ngram", ...}.
Parts:
- batch1: each workload's chat alone, greedy, up to --max-tokens tokens, from an empty
  prefix cache: decode tok/s = (tokens - 1) / (last token - first token), the engine's own
  timestamps, so prefill is left out (it is the same work on both). `same tokens` counts the
  leading tokens both give: all of them in float32 (--dtype float32); in bf16 a verify step's
  rows may round differently from a one-row step's (the quantized kernels sum a tile of one or
  two rows in another order), so a near tie can go the other way, as it can between a request
  alone and in a batch.
  Workloads: `passage` (repeat a passage with one word changed), `code` (a code block with one
  name changed), `agent` (a tool loop whose earlier calls and results the next turn repeats),
  and `open` (a question whose answer copies nothing: drafts rarely come, and must cost nothing).
- loop: an agent's loop of four steps, each its own request, run --loops times on a plain, an
  ngram and a suffix engine (`{"method": "suffix"}`, vLLM's suffix defaults, --suffix-k drafts
  at most), greedy, batch 1: decode tok/s over every loop after the first (which fills the
  suffix cache with the answers the later loops repeat; no prompt holds them). Goal: suffix
  >= 1.5x plain.
- turnoff: at concurrency 1..32 (one generate() of that many chats: copies of the passage chat,
  the four workloads in turn, or open questions), ngram and suffix with no batch cap on drafts
  (disable_by_batch_size large: the acceptance rule alone) against plain: output tok/s over wall time, every request
  running --max-tokens / 2 tokens (ignore_eos), so that both sides make the same tokens. A ratio
  under 1 is a batch size where drafts cost more than they give on this CPU.
- conc32: 32 chats at once (the four workloads in turn), as many tokens each as in turnoff,
  ngram and suffix in their default configurations against plain: output tok/s (goal >= 0.95x).
Systems alternate, the order reversed every round; medians over --rounds. Writes
bench/results/speculative.json and speculative.png (ratio against concurrency), the CPU named.
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.common import cpu_info, write_result

PASSAGE = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. "
           "Every night its keeper climbed the narrow stairs, lit the great lamp, and watched the "
           "ships pass safely through the dark water below. The villagers said that the light had "
           "never once failed, not even during the worst storms of winter. When the keeper grew "
           "old, his daughter took over the work. She repaired the broken windows, painted the "
           "iron railings white again, and kept a careful log of every ship that passed. Years "
           "later, when the harbour was closed and the lighthouse was no longer needed, the "
           "village turned it into a small museum, and her log books are still kept there today.")
CODE = '''def total_price(items, tax_rate, discount=None):
    subtotal = 0
    for item in items:
        if item.quantity <= 0:
            continue
        subtotal += item.price * item.quantity
    if discount is not None:
        subtotal = subtotal - discount
    tax = subtotal * tax_rate
    return subtotal + tax


def average_price(items):
    if not items:
        return 0
    return sum(item.price for item in items) / len(items)'''
TOOL_CALL = '{"name": "search_files", "arguments": {"pattern": "TODO", "path": "src/"}}'
TOOL_RESULT = ("src/app.py:12: TODO handle errors from the payment service\n"
               "src/db.py:40: TODO close the connection when the pool shuts down\n"
               "src/api.py:88: TODO validate the request body before saving it")
WORKLOADS = {
    "passage": [{"role": "user", "content": "Repeat this passage exactly, word for word, but "
                 f"change 'lighthouse' to 'tower':\n\n{PASSAGE}"}],
    "code": [{"role": "user", "content": "Rename the variable `subtotal` to `net` in this code "
              f"and output the whole code:\n\n{CODE}"}],
    "agent": [{"role": "system", "content": "You call tools by writing their JSON call."},
              {"role": "user", "content": "Find the TODOs in src/ and list them."},
              {"role": "assistant", "content": TOOL_CALL},
              {"role": "user", "content": f"Tool result:\n{TOOL_RESULT}\n\nList every TODO "
               "found, quoting each line exactly as the tool printed it."}],
    "open": [{"role": "user", "content": "Why do cats purr? Answer in a few sentences."}],
}
# Open questions: answers that copy little, where drafts are rarely right.
QUESTIONS = ["Why do cats purr?", "What makes the sky blue?", "How do bees make honey?",
             "Why is the sea salty?", "How do airplanes fly?", "What is a black hole?",
             "Why do leaves change colour?", "How does a compass work?"]
CONCURRENCY = (1, 2, 4, 8, 16, 32)
# An agent's loop: the same few steps every iteration, each a request of its own whose answer
# no prompt holds, as a coding or operations agent re-plans, re-calls and re-reports.
LOOP_STEPS = ["Write the JSON tool call that searches src/ for the pattern TODO.",
              "List three steps to fix a failing unit test, one line each.",
              "Write a short commit message for a change that closes a database connection.",
              "Summarize in two sentences what a code review should check first."]


def agent_loop() -> list[list[dict]]:
    system = {"role": "system", "content": "You are a coding agent. Answer briefly."}
    return [[system, {"role": "user", "content": step}] for step in LOOP_STEPS]


def decode_rate(output) -> float:
    m = output.metrics
    n = len(output.outputs[0].token_ids)
    return (n - 1) / (m["finish_time"] - m["first_token_time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="batch1,loop,turnoff,conc32")
    parser.add_argument("--suffix-k", type=int, default=16, help="suffix: drafts per step, at most")
    parser.add_argument("--loops", type=int, default=4, help="loop: times the agent loop runs")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="activations: auto (the default), float32")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.rounds = 32, 1
    parts = args.parts.split(",")
    lookup_min, lookup_max = (int(x) for x in args.lookup.split(","))

    from pagedserve import LLM, SamplingParams

    common = {"dtype": args.dtype, **({"num_threads": args.threads} if args.threads else {})}
    config = {"method": "ngram", "num_speculative_tokens": args.k,
              "prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max}
    engines = {"plain": LLM(None, **common),
               "ngram": LLM(None, speculative_config=config, **common)}
    suffix_config = {"method": "suffix", "num_speculative_tokens": args.suffix_k}
    # No batch cap: the acceptance rule alone decides (the turn-off part).
    uncapped = {name: LLM(None, speculative_config={**cfg, "disable_by_batch_size": 1024},
                          **common) for name, cfg in (("ngram", config), ("suffix", suffix_config))
                } if "turnoff" in parts else {}
    suffix = LLM(None, speculative_config=suffix_config, **common) \
        if "loop" in parts or "conc32" in parts else None
    # The answer ends where the model ends it: past its end a small model rambles, and copying
    # the context is what the workloads measure.
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def chat(llm, conversations):
        llm.llm_engine.block_manager.reset_prefix_cache()
        return llm.chat(conversations, params, use_tqdm=False)

    def alternate(systems: dict, fn, rounds: int) -> dict[str, list]:
        results = {name: [] for name in systems}
        for r in range(rounds):
            order = list(systems) if r % 2 == 0 else list(reversed(systems))
            for name in order:
                results[name].append(fn(systems[name]))
        return results

    for llm in (*engines.values(), *uncapped.values()):
        chat(llm, [WORKLOADS["passage"]])  # warm-up
    result = {"config": config, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "dtype": engines["plain"].llm_engine.runner.platform["dtype"]}

    if "batch1" in parts:
        result["batch1"] = {}
        for name, conversation in WORKLOADS.items():
            spec = engines["ngram"].llm_engine.speculator
            before = (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_drafts)
            runs = alternate(engines, lambda llm: chat(llm, [conversation])[0], args.rounds)
            texts = {n: runs[n][-1].outputs[0].text for n in runs}
            ids = {n: runs[n][-1].outputs[0].token_ids for n in runs}
            same = next((i for i, (a, b) in enumerate(zip(ids["plain"], ids["ngram"])) if a != b),
                        len(ids["plain"]))
            rates = {n: statistics.median(decode_rate(o) for o in runs[n]) for n in runs}
            drafted = spec.num_draft_tokens - before[0]
            accepted = spec.num_accepted_tokens - before[1]
            runs_verified = spec.num_drafts - before[2]
            row = {"plain_tok_s": rates["plain"], "ngram_tok_s": rates["ngram"],
                   "speedup": rates["ngram"] / rates["plain"],
                   "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_accepted_length": 1 + accepted / runs_verified if runs_verified else 0.0,
                   "same_tokens": same, "text": texts["plain"][:200]}
            result["batch1"][name] = row
            print(f"batch 1 {name:8s} plain {row['plain_tok_s']:6.1f} tok/s  ngram "
                  f"{row['ngram_tok_s']:6.1f} tok/s  x{row['speedup']:.2f}  acceptance "
                  f"{row['acceptance_rate']:.2f}  mean run {row['mean_accepted_length']:.2f}  "
                  f"same tokens {same}/{len(ids['plain'])}")

    fixed = SamplingParams(temperature=0, max_tokens=args.max_tokens // 2, ignore_eos=True)

    def throughput(llm, conversations) -> float:
        llm.llm_engine.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.chat(conversations, fixed, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    if "loop" in parts:
        # Each engine runs the agent loop --loops times, greedy, its answers ending where the
        # model ends them; the first loop fills the suffix cache, the later ones are measured.
        systems = {"plain": engines["plain"], "ngram": engines["ngram"], "suffix": suffix}
        rates: dict[str, list[float]] = {n: [] for n in systems}
        texts: dict[str, list[str]] = {n: [] for n in systems}
        for loop in range(args.loops):
            for name in (list(systems) if loop % 2 == 0 else list(reversed(systems))):
                for turn in agent_loop():
                    out = chat(systems[name], [turn])[0]
                    if loop:
                        rates[name].append(decode_rate(out))
                        texts[name].append(out.outputs[0].text)
        spec = suffix.llm_engine.speculator
        medians = {n: statistics.median(v) for n, v in rates.items()}
        result["loop"] = {**{f"{n}_tok_s": v for n, v in medians.items()},
                          "suffix_speedup": medians["suffix"] / medians["plain"],
                          "ngram_speedup": medians["ngram"] / medians["plain"],
                          "suffix_acceptance_rate": spec.stats()["spec_decode_acceptance_rate"],
                          "same_text": texts["suffix"] == texts["plain"] == texts["ngram"],
                          "suffix_config": suffix_config}
        print(f"agent loop  plain {medians['plain']:6.1f} tok/s  ngram {medians['ngram']:6.1f} "
              f"(x{medians['ngram'] / medians['plain']:.2f})  suffix {medians['suffix']:6.1f} "
              f"(x{medians['suffix'] / medians['plain']:.2f}, acceptance "
              f"{result['loop']['suffix_acceptance_rate']:.2f})  same text "
              f"{result['loop']['same_text']}")

    names = list(WORKLOADS)

    def mixed(c: int) -> list:
        return [WORKLOADS[names[i % len(names)]] for i in range(c)]

    def chats_of(mix: str, c: int) -> list:
        if mix == "passage":
            return [WORKLOADS["passage"]] * c
        if mix == "open":
            return [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} Answer in a "
                      "few sentences."}] for i in range(c)]
        return mixed(c)

    if "turnoff" in parts:
        result["turnoff"] = {}
        for mix in ("passage", "mixed", "open"):
            result["turnoff"][mix] = {}
            for c in CONCURRENCY:
                chats = chats_of(mix, c)
                systems = {"plain": engines["plain"], **uncapped}
                runs = alternate(systems, lambda llm: throughput(llm, chats), args.rounds)
                rates = {n: statistics.median(v) for n, v in runs.items()}
                result["turnoff"][mix][c] = {**rates, **{f"{n}_ratio": rates[n] / rates["plain"]
                                                         for n in uncapped}}
                print(f"turn-off {mix:7s} c={c:2d}  plain {rates['plain']:7.1f} tok/s  " + "  ".join(
                    f"{n} {rates[n]:7.1f} (x{rates[n] / rates['plain']:.2f})" for n in uncapped))

    if "conc32" in parts:
        conversations = mixed(32)
        runs = alternate({**engines, "suffix": suffix},
                         lambda llm: throughput(llm, conversations), args.rounds)
        rates = {n: statistics.median(v) for n, v in runs.items()}
        result["conc32"] = {**rates, "ratio": rates["ngram"] / rates["plain"],
                            "suffix_ratio": rates["suffix"] / rates["plain"], "goal": 0.95}
        print(f"concurrency 32 (default configurations): plain {rates['plain']:.1f} tok/s  ngram "
              f"{rates['ngram']:.1f} (x{rates['ngram'] / rates['plain']:.2f})  suffix "
              f"{rates['suffix']:.1f} (x{rates['suffix'] / rates['plain']:.2f}); goal >= 0.95")

    cpu = cpu_info()
    path = write_result("speculative", result)
    if "turnoff" in result:
        plot(path.with_suffix(".png"), result, cpu)
    print(f"wrote {path}  ({cpu.get('model')}, level {cpu.get('level')})")


def plot(path, result: dict, cpu: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mix, points in result["turnoff"].items():
        xs = list(points)
        for method, style in (("ngram", "-"), ("suffix", "--")):
            ax.plot(xs, [points[c][f"{method}_ratio"] for c in xs], style, marker="o",
                    label=f"{method}, {mix} chats")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s / plain decoding")
    ax.set_title("speculation with no batch cap (the acceptance rule alone)\n"
                 f"{cpu.get('model')} ({cpu.get('level')})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
