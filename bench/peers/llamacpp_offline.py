"""Batch-1 greedy decode of a GGUF file with `llama_cpp.Llama`; runs inside the llama.cpp virtual
environment (not ours).

The workload is a JSON file written by bench/peers/gguf.py (or gguf_speculative.py): {"warmup":
[ids], "prompts": [[ids], ...], "output_len": N}, the same token ids our engine gets, and
optionally "stop_ids": [ids]. Each prompt runs alone from an empty KV cache (`reset()`, so nothing
is reused from the previous one), greedy (`temp=0`: llama.cpp's greedy sampler, no penalties),
`output_len` tokens whatever they are (`generate` never stops at end-of-generation), or up to the
first of stop_ids where the workload has them. Time to the first token is the prefill; the rest
is decode. --lookup K decodes with llama-cpp-python's prompt lookup (LlamaPromptLookupDecoding,
K tokens proposed per step, n-grams up to --lookup-ngram).

    <llama.cpp venv>/bin/python bench/peers/llamacpp_offline.py --model X.gguf --workload W.json --threads N --out R.json
    <llama.cpp venv>/bin/python bench/peers/llamacpp_offline.py --model X.gguf --eog   # end-of-generation token ids, as JSON
"""
from __future__ import annotations

import argparse
import json
import resource
import time


def eog_ids(model: str) -> list[int]:
    import llama_cpp
    llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    vocab = llm._model.vocab  # llama.cpp's own end-of-generation set (eos, eot, <|im_end|>...)
    return [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]


def run_prompt(llm, prompt: list[int], output_len: int, stop_ids: frozenset = frozenset()
               ) -> tuple[dict, list[int]]:
    llm.reset()
    start = time.perf_counter()
    tokens, first = [], None
    generator = llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
    for token in generator:
        tokens.append(token)
        if first is None:
            first = time.perf_counter()
        if len(tokens) == output_len or token in stop_ids:
            break
    end = time.perf_counter()
    generator.close()
    return {"ttft_s": first - start, "decode_s": end - first, "output_tokens": len(tokens)}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--eog", action="store_true", help="print the end-of-generation token ids")
    parser.add_argument("--lookup", type=int, default=0, help="prompt lookup decoding: tokens proposed")
    parser.add_argument("--lookup-ngram", type=int, default=2, help="prompt lookup's longest n-gram")
    args = parser.parse_args()
    if args.eog:
        print(json.dumps(eog_ids(args.model)))
        return

    import llama_cpp

    with open(args.workload) as f:
        workload = json.load(f)
    output_len = workload["output_len"]
    longest = max(len(p) for p in [workload["warmup"], *workload["prompts"]])
    began = time.perf_counter()
    draft = None
    if args.lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(max_ngram_size=args.lookup_ngram,
                                          num_pred_tokens=args.lookup)
    llm = llama_cpp.Llama(args.model, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=longest + output_len + 16, seed=0, verbose=False,
                          draft_model=draft)
    load_s = time.perf_counter() - began
    run_prompt(llm, workload["warmup"], 4)
    runs, first_tokens, all_tokens = [], None, []
    for prompt in workload["prompts"]:
        run, tokens = run_prompt(llm, prompt, output_len, frozenset(workload.get("stop_ids", ())))
        runs.append(run)
        first_tokens = first_tokens or tokens
        all_tokens.append(tokens)
    result = {"runs": runs, "load_s": load_s, "first_prompt_tokens": first_tokens,
              "tokens": all_tokens,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "version": llama_cpp.__version__,
              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
