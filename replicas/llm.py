"""vLLM's offline API: LLM(model).generate(prompts, sampling_params), LLM.chat(...) and, for an
embedding model, LLM.embed(prompts)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.model_files.embedding_model import resolve_model_name, uses_encoder
from pagedserve.replicas.engine.encoder_engine import EmbedInput, EncoderEngine
from pagedserve.replicas.engine.llm_engine import LLMEngine, PromptInput
from pagedserve.replicas.core.lora_request import LoRARequest
from pagedserve.replicas.core.outputs import RequestOutput
from pagedserve.replicas.core.pooling import EmbeddingOutput, EmbeddingRequestOutput, pooling_params
from pagedserve.replicas.core.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict]


class LLM:
    """Offline batched generation on one engine. `model=None` serves the embedded default model."""

    def __init__(self, model: str | None = None, **engine_args):
        config = EngineConfig(model=model, **engine_args)
        # An encoder checkpoint (an embedding model) has no generating engine, only embed().
        self.encoder = EncoderEngine(config, resolve_model_name(model)) if uses_encoder(model) else None
        self.llm_engine = LLMEngine(config) if self.encoder is None else None
        self._request_ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes (also done at exit)."""
        if self.llm_engine is not None:
            self.llm_engine.shutdown()

    def get_tokenizer(self):
        return (self.encoder or self.llm_engine).tokenizer

    def embed(self, prompts: EmbedInput | SequenceABC[EmbedInput], use_tqdm: bool = True,
              lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One output per prompt (a text or token ids), in order; `.outputs.embedding` is the
        pooled (normalized, where the model says so) embedding as a list of floats. A decoder's
        embeddings may come from its LoRA adapters (`lora_request`, as in generate)."""
        if self.encoder is None:  # a decoder: pooling requests through its scheduler
            mode = self.llm_engine.config.pooling
            if mode is None:
                raise ValueError("this model generates: embed() needs an encoder checkpoint (e.g. a "
                                 "sentence-transformers directory) or the engine setting pooling")
            outputs = self.generate(prompts, pooling_params(mode), use_tqdm=use_tqdm,
                                    lora_request=lora_request)
            return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding),
                                           o.prompt_token_ids) for o in outputs]
        if lora_request is not None:
            raise ValueError("LoRA adapters apply to a decoder's embeddings, not an encoder's")
        prompts = [p.get("prompt_token_ids", p.get("prompt")) if isinstance(p, dict) else p
                   for p in _as_prompt_list(prompts)]
        token_ids = self.encoder.tokenize(prompts)
        outputs = []
        with tqdm(total=len(prompts), desc="Embedded prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            for start, end in self.encoder.batches(token_ids):
                rows = self.encoder.embed_batch(token_ids[start:end])
                outputs += [EmbeddingRequestOutput(f"embed-{next(self._request_ids)}",
                                                   EmbeddingOutput(row.tolist()), ids)
                            for row, ids in zip(rows, token_ids[start:end])]
                bar.update(end - start)
        return outputs

    def generate(self, prompts: PromptInput | SequenceABC[PromptInput],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
                 priority: SequenceABC[int] | None = None) -> list[RequestOutput]:
        """Outputs come back in the order of the prompts. `lora_request` (one, or one per prompt)
        needs enable_lora; `priority` (one per prompt) needs scheduling_policy="priority"."""
        if self.llm_engine is None:
            raise ValueError("this model is an embedding model: it does not generate (use embed())")
        prompts = _as_prompt_list(prompts)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        # Only the finished outputs are read: no output is built for a request until then.
        requests = [engine.make_request(rid, p, sp.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                                        priority=prio, lora_request=lora)
                    for rid, p, sp, prio, lora in zip(ids, prompts, params, priorities, loras)]
        results: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                engine.add(request)
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                      dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
                    for _, exc in engine.take_failures():  # a grammar or an adapter that failed
                        raise exc
        finally:  # an interrupt must not leave requests holding KV blocks
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
        return [results[rid] for rid in ids]

    def chat(self, messages: Conversation | SequenceABC[Conversation],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
             chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        if self.llm_engine is None:
            raise ValueError("this model is an embedding model: it does not generate (use embed())")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.llm_engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt of token ids
        return [prompts]
    return prompts
