"""vLLM's offline API: LLM(model).generate(prompts, sampling_params) and LLM.chat(...)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from replicas.config import EngineConfig
from replicas.engine import LLMEngine, PromptInput
from replicas.outputs import RequestOutput
from replicas.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict]


class LLM:
    """Offline batched generation on one engine. `model=None` serves the embedded default model."""

    def __init__(self, model: str | None = None, **engine_args):
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptInput | SequenceABC[PromptInput],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs come back in the order of the prompts."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        # Only the finished outputs are read: no output is built for a request until then.
        requests = [engine.make_request(rid, p, sp.clone(output_kind=RequestOutputKind.FINAL_ONLY))
                    for rid, p, sp in zip(ids, prompts, params)]
        for request in requests:
            engine.add(request)
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                      dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
        finally:  # an interrupt must not leave requests holding KV blocks
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
        return [results[rid] for rid in ids]

    def chat(self, messages: Conversation | SequenceABC[Conversation],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.llm_engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt of token ids
        return [prompts]
    return prompts
