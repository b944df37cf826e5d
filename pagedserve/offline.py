"""`pagedserve generate` / `pagedserve chat`: the offline `LLM` on the same engine flags."""
from __future__ import annotations

import argparse
import sys
from typing import Any


def run_offline(ns: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from pydantic import ValidationError

    from pagedserve import LLM, SamplingParams

    try:
        llm = LLM(**engine_args)
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                                top_p=ns.top_p)
    except (ValidationError, ValueError) as exc:
        raise SystemExit(f"pagedserve {ns.command}: {one_line(exc)}") from None
    if ns.command == "generate":
        prompts = ns.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
        for output in llm.generate(prompts, params, use_tqdm=False):
            print(output.prompt + output.outputs[0].text, flush=True)
            print(flush=True)
        return 0
    return chat(llm, params)


def chat(llm, params) -> int:
    """One conversation, a turn per line of input, until EOF (Ctrl-D) or an empty line."""
    messages: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
                         for e in exc.errors())
    return " ".join(str(exc).split())
