"""A small stand-in for AsyncEngine with the same surface, for fast tests of the serving layer.

It "generates" deterministic tokens (the prompt's last token + 1, + 2, ... modulo the vocabulary)
with a short sleep per step, keeps a fake KV-block pool so aborts can be checked, and honours
n, max_tokens, stop strings and logprobs well enough to exercise the formatters.
"""
from __future__ import annotations

import asyncio
import math

from replicas.config import EngineConfig
from replicas.outputs import CompletionOutput, Logprob, RequestOutput
from replicas.sampling_params import SamplingParams

STEP_S = 0.002
NUM_BLOCKS = 256


class FakeEngine:
    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.max_model_len = config.max_model_len or 256
        self.model_name = config.served_model_name or "fake"
        self.block_size = config.block_size
        self.num_free_blocks = NUM_BLOCKS
        self.num_running = 0
        self.num_steps = 0
        self.healthy = True

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens.")
        vocab = len(self.tokenizer)
        blocks = params.n * math.ceil((len(ids) + max_tokens) / self.block_size)
        self.num_free_blocks -= blocks
        self.num_running += params.n
        outputs = [CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                   for i in range(params.n)]
        finished = False
        try:
            for step in range(max_tokens):
                await asyncio.sleep(STEP_S)
                self.num_steps += 1
                for out in outputs:
                    if out.finish_reason is not None:
                        continue
                    token = (ids[-1] + 1 + step + out.index) % vocab
                    out.token_ids = out.token_ids + [token]
                    out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                    if out.logprobs is not None:
                        out.logprobs = out.logprobs + [{token: Logprob(-0.5, 1, self.tokenizer.decode([token]))}]
                    hit = next((s for s in params.stop if s in out.text), None)
                    if hit is not None:
                        out.text = out.text[:out.text.index(hit)]
                        out.finish_reason, out.stop_reason = "stop", hit
                    elif len(out.token_ids) == max_tokens:
                        out.finish_reason = "length"
                finished = all(o.finish_reason is not None for o in outputs)
                yield RequestOutput(request_id, None, ids,
                                    [CompletionOutput(o.index, o.text, list(o.token_ids),
                                                      logprobs=None if o.logprobs is None else list(o.logprobs),
                                                      finish_reason=o.finish_reason,
                                                      stop_reason=o.stop_reason) for o in outputs],
                                    finished=finished, num_cached_tokens=0)
                if finished:
                    return
        finally:
            self.num_free_blocks += blocks
            self.num_running -= params.n

    async def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict:
        return {"num_waiting": 0, "num_running": self.num_running, "kv_blocks_total": NUM_BLOCKS,
                "kv_blocks_free": self.num_free_blocks,
                "kv_cache_usage": 1 - self.num_free_blocks / NUM_BLOCKS,
                "prefix_cache_hit_rate": 0.0, "num_preemptions": 0, "num_steps": self.num_steps}

    def is_healthy(self) -> bool:
        return self.healthy

    def shutdown(self) -> None:
        self.healthy = False
