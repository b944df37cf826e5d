"""LLMEngine: one replica's engine. step() = schedule -> execute -> update, as in vLLM v1.

Knows nothing of Ray or asyncio: the offline `LLM` drives it directly, an engine core
(`replicas/engine/core.py`) from its loop.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from pagedserve.replicas.core.block_manager import BlockManager, kv_window_of
from pagedserve.replicas.core.cache_digest import autoscaling_inputs
from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.model_files.default_model import DEFAULT_MODEL_NAME, resolve_model
from pagedserve.replicas.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from pagedserve.replicas.core.errors import StepFailed
from pagedserve.replicas.models.loader import resolve_device, tokenizer_path
from pagedserve.replicas.execution.model_runner import ModelRunner, RunnerOutput
from pagedserve.replicas.core.outputs import RequestOutput
from pagedserve.replicas.core.request import PromptInput, Request
from pagedserve.replicas.core.block_hash import block_hashes
from pagedserve.replicas.core.reasoning import ThinkingTokens
from pagedserve.replicas.core.lora_request import LoRARequest, adapter_root_hash
from pagedserve.replicas.engine.pending import PendingRequests
from pagedserve.replicas.core.sampling_params import ParamError, SamplingParams
from pagedserve.replicas.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.replicas.core.sequence import Sequence, SequenceStatus
from pagedserve.replicas.core.step_load import StepLoad
from pagedserve.replicas.lora.adapter import AdapterError
from pagedserve.replicas.structured import GrammarCompiler, attach_grammar

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer

        self.config = config
        self.model_dir = resolve_model(config.model, default_format=_default_model_format(config))
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(config.tokenizer or self.model_dir))
        self.token_decoder = TokenDecoder(self.tokenizer)
        # A reasoning model's tags: its grammars constrain only the answer after the thinking.
        self.thinking = (ThinkingTokens.of(config.reasoning_parser, self.tokenizer)
                         if config.reasoning_parser else None)
        self.runner = ModelRunner(config, self.model_dir)
        self.max_model_len = self.runner.model.set_max_model_len(config.max_model_len)
        self.model_name = config.served_model_name or config.model or DEFAULT_MODEL_NAME
        self.block_size = config.block_size
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.tokenizer)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
            sliding_window=kv_window_of(getattr(self.runner.model, "sliding_windows", None)))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   config.enable_chunked_prefill, config.scheduling_policy,
                                   config.max_loras if config.enable_lora else None)
        self.lora = self.runner.lora  # the LoRAManager under enable_lora, else None
        self.speculator = None  # drafts for the next step, under speculative_config
        if config.speculative_config is not None:
            from pagedserve.replicas.spec.speculator import Speculator
            self.speculator = Speculator(config.speculative_config, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
        self.pending = PendingRequests(self._admit)  # grammars compiling, adapters loading
        self.num_steps = 0
        self.step_load = StepLoad()  # the autoscaler's compute signal
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_arrived = 0  # requests ever added: routers compare their own sends with it

    # -- requests ---------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                     arrival_time: float | None = None, priority: int = 0,
                     lora_request: LoRARequest | None = None) -> Request:
        """Validate and tokenize; touches no engine state, so it is safe from any thread.

        What only the engine knows is checked here (the context it serves, its KV capacity, its
        max_logprobs); `SamplingParams` checked itself when it was made. A dict prompt may carry
        the prompt's `block_hashes` (the ingress computed them to route it, chained from the
        adapter's root): its sequences use them instead of hashing the prompt again. Errors are
        `ParamError`s naming the field.
        """
        params = (params or SamplingParams()).clone()
        text, token_ids, hashes = self._tokenize(prompt)
        if not token_ids:
            raise ParamError("prompt", "the prompt is empty: it must contain at least one token")
        if max(token_ids) >= self.runner.vocab_size or min(token_ids) < 0:
            raise ParamError("prompt", f"prompt token ids must be in [0, {self.runner.vocab_size})")
        num_prompt = len(token_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt
            params.max_tokens = max(max_tokens, 1)
        if num_prompt + max_tokens > self.max_model_len:
            raise ParamError("prompt",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.")
        # Under a sliding window a sequence holds only its window's blocks, whatever its length.
        step_tokens = min(num_prompt, self.config.max_num_batched_tokens) \
            if self.config.enable_chunked_prefill else num_prompt
        needed = self.block_manager.max_blocks_held(num_prompt + max_tokens, step_tokens)
        if needed > self.block_manager.num_blocks:
            raise ParamError("max_tokens", f"the request needs up to {needed * self.block_size} "
                             f"tokens of KV cache at once but this replica holds only "
                             f"{self.block_manager.num_blocks * self.block_size}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ParamError(name, f"{name} must be at most {self.config.max_logprobs}")
        if priority and self.config.scheduling_policy != "priority":
            raise ParamError("priority", f"got priority {priority} but priority scheduling is not "
                             f"enabled (scheduling_policy=priority)")
        if lora_request is not None and self.lora is None:
            raise ParamError("model", f"LoRA adapter {lora_request.lora_name!r} requested, but "
                             "LoRA is not enabled (enable_lora)")
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        params.eos_token_ids = set(self.eos_token_ids)
        request = Request(request_id, text, token_ids, params,
                          arrival_time=arrival_time or time.monotonic(), lora=lora_request)
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size, adapter_root_hash(lora_id))
        for i in range(params.n):
            seq = Sequence(request_id, token_ids, params, self.block_size, index=i,
                           eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
                           arrival_time=request.arrival_time, block_hashes=list(hashes),
                           priority=priority, lora_id=lora_id)
            request.seqs.append(seq)
            request.detokenizers.append(
                IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                       params.spaces_between_special_tokens, params.stop,
                                       params.include_stop_str_in_output, params.min_tokens)
                if params.detokenize else None)
            request.logprobs.append([])
            request.cumulative_logprobs.append(0.0)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        if params.structured_outputs is not None:
            request.grammar = self.grammars.compile(params.structured_outputs)
        return request

    def load_adapter(self, lora: LoRARequest):
        """Read and check an adapter now, off the engine loop: a Future of it (or of its
        AdapterError). Requests need not wait for this: one whose adapter is not loaded waits
        while it loads."""
        if self.lora is None:
            raise ParamError("lora_name", "LoRA is not enabled on this engine (enable_lora)")
        return self.lora.load(lora)

    def remove_adapter(self, lora_id: int) -> bool:
        """Forget an adapter; requests still holding it keep it until they finish."""
        return self.lora is not None and self.lora.remove(lora_id)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.num_arrived += 1
        if request.lora is not None:
            request.adapter = self.lora.load(request.lora)
        if not all(f.done() for f in request.waits_on()):
            self.requests[request.request_id] = request
            self.pending.add(request)  # the scheduler sees it once it is ready
            return
        self._admit(request)  # raises the ParamError of a grammar or an adapter that failed
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        self.add(self.make_request(request_id, prompt, params, arrival_time, priority, lora_request))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if self.pending.pop(request_id) is not None:  # never reached the scheduler
            for seq in request.seqs:
                seq.status = SequenceStatus.FINISHED_ABORTED
            if request.adapter is not None:
                self.lora.discard(request.adapter)
        self._release_adapter(request)
        for seq in request.seqs:
            self._finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
        request.finish_time = time.monotonic()
        return request.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def check_health(self) -> None:
        """RuntimeError when part of the engine (a tensor-parallel rank) has died."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Stop the runner's tensor-parallel ranks, if any; the engine is unusable after."""
        self.runner.shutdown()

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for every request that advanced or finished (only
        the finished ones under RequestOutputKind.FINAL_ONLY)."""
        if self.pending:
            self._admit_pending()
        began = time.monotonic()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if self.pending:  # nothing else to do: wait a moment for a grammar or an adapter
                self.pending.wait(0.01)
            return []
        try:
            runner_output = self.runner.execute(scheduler_output)
            outputs = self.update_from_output(scheduler_output, runner_output)
        except Exception as exc:
            raise self._fail_step(scheduler_output, exc) from exc
        ended = time.monotonic()
        self.step_load.record(ended, ended - began, scheduler_output.num_batched_tokens)
        if self.speculator is not None:
            self.speculator.observe_step(ended - began, scheduler_output.num_batched_tokens,
                                         self.step_load.light_s)
        return outputs

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[RequestOutput]:
        self.num_steps += 1
        self.block_manager.record_slot_usage(self.scheduler.running)
        self.num_prompt_tokens += sum(s.num_new_tokens for s in scheduler_output.scheduled
                                      if not s.samples)
        for seq_id, (start, positions) in runner_output.prompt_logprobs.items():
            self._add_prompt_logprobs(scheduler_output.seq(seq_id), start, positions)
        for seq_id, embedding in runner_output.pooled.items():  # it finishes in this update
            self.requests[scheduler_output.seq(seq_id).request_id].embedding = embedding
        now = time.monotonic()
        touched: dict[str, Request] = {}
        scheduler = self.scheduler
        spec = {s.seq.seq_id: len(s.spec_token_ids) for s in scheduler_output.scheduled
                if s.spec_token_ids} if self.speculator is not None else None
        for seq, token_ids, logprobs in zip(scheduler_output.sampling,
                                            runner_output.sampled_token_ids,
                                            runner_output.logprobs, strict=True):
            request = self.requests[seq.request_id]
            touched[request.request_id] = request
            if request.first_token_time is None:
                request.first_token_time = now
            if spec and seq.seq_id in spec:
                self.speculator.record(seq, spec[seq.seq_id], len(token_ids) - 1)
            # Token by token: a stop token, max_tokens, a stop string or the grammar's end may
            # come inside a verified run, and the tokens after it are dropped.
            for i, token_id in enumerate(token_ids):
                self.num_generation_tokens += 1
                stopped = not scheduler.append_token(seq, token_id)
                if logprobs is not None:
                    if request.sampling_params.detokenize:  # else the ingress decodes them
                        self._fill_decoded([logprobs[i]])
                    request.logprobs[seq.index].append(logprobs[i])
                    request.cumulative_logprobs[seq.index] += logprobs[i][token_id].logprob
                self._detokenize(request, seq, token_id)
                if seq.grammar is not None and not seq.is_finished:
                    self._advance_grammar(seq)
                if stopped:  # ended by the scheduler (the others released it as they ended it)
                    self._release(seq)
                if seq.is_finished:
                    break
            scheduler.end_step(seq)
        outputs = []
        for request in touched.values():
            if request.finished:
                request.finish_time = now
                del self.requests[request.request_id]
                self._release_adapter(request)
            if request.wants_output:
                outputs.append(request.output())
        return outputs

    def take_failures(self) -> list[tuple[str, ParamError]]:
        """Requests that ended with an error of their own since the last call (a grammar that
        failed to compile), as (request_id, error); they produce no output."""
        failures, self.pending.failures = self.pending.failures, []
        return failures

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: scheduled or waiting for their grammar or adapter."""
        return self.scheduler.num_waiting + len(self.pending)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_waiting": self.num_waiting,
            "num_running": self.scheduler.num_running,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "num_requests": len(self.requests),
            "num_arrived": self.num_arrived,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_cache_usage": bm.usage,
            "prefix_cache_hit_rate": bm.hit_rate,
            "prefix_cache_queries": bm.num_query_tokens,
            "prefix_cache_hits": bm.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "kv_slot_waste": bm.kv_slot_waste,
            **autoscaling_inputs(bm, self.step_load, time.monotonic()),
            **self.runner.platform,  # dtype, kv_cache_dtype, cpu: model, level, flags, kernels
            **(self.lora.stats() if self.lora is not None else {}),
            **(self.speculator.stats() if self.speculator is not None else {}),
        }

    # -- internals --------------------------------------------------------------------------
    def _admit_pending(self) -> None:
        for request in self.pending.take_ready():
            for seq in request.seqs:
                self.scheduler.add(seq)
        for request_id, _ in self.pending.failures:
            self.requests.pop(request_id, None)

    def _admit(self, request: Request) -> None:
        """A request whose grammar and adapter are ready: its matchers attached, its adapter in
        memory and held until it ends. Raises the ParamError of either that failed."""
        if request.grammar is not None:
            attach_grammar(request, self.thinking)
        if request.adapter is not None:
            try:
                self.lora.admit(request.adapter, hold=True)
            except AdapterError as exc:
                raise ParamError("model", f"LoRA adapter {request.lora.lora_name!r}: {exc}") from None
            request.adapter, request.holds_adapter = None, True

    def _release_adapter(self, request: Request) -> None:
        if request.holds_adapter:
            request.holds_adapter = False
            self.lora.release(request.lora.lora_int_id)

    def _advance_grammar(self, seq: Sequence) -> None:
        """After a sampled token: the grammar follows; complete, the sequence stops there."""
        seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)
        if seq.grammar.is_terminated:
            self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED)

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> StepFailed:
        """Abort the step's requests: whatever state the failure left them in goes with them."""
        request_ids = list(dict.fromkeys(s.seq.request_id for s in scheduler_output.scheduled))
        for request_id in request_ids:
            self.abort_request(request_id)
        logger.error("engine step failed; aborted its %d request(s): %r", len(request_ids), exc)
        return StepFailed(request_ids, f"{type(exc).__name__}: {exc}")

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int], list[int] | None]:
        """(text, token ids, the prompt's block hashes if the caller gave them)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return (prompt.get("prompt"), list(prompt["prompt_token_ids"]),
                        prompt.get("block_hashes"))
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt), None
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), None
        raise ParamError("prompt", "a prompt must be a string, a list of token ids, or a dict "
                         "with 'prompt' or 'prompt_token_ids'")

    def _detokenize(self, request: Request, seq: Sequence, token_id: int) -> None:
        detok = request.detokenizers[seq.index]
        if detok is None:
            return
        # An eos / stop token's own text is left out, as in vLLM.
        detok.append([token_id], stop_terminated=seq.status is SequenceStatus.FINISHED_STOPPED)
        if detok.stop_str is not None and not seq.is_finished:
            seq.stop_reason = detok.stop_str
            self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED)

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, status)
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """A finished sequence's state outside the scheduler: the runner's, the speculator's."""
        self.runner.release(seq.seq_id)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _add_prompt_logprobs(self, seq: Sequence, start: int, positions: list) -> None:
        # After a preemption the prompt is recomputed: keep only positions not seen before.
        known = self.requests[seq.request_id].prompt_logprobs
        skip = len(known) - (start + 1)
        if 0 <= skip < len(positions):
            if self.requests[seq.request_id].sampling_params.detokenize:
                self._fill_decoded(positions[skip:])
            known.extend(positions[skip:])

    def _fill_decoded(self, positions) -> None:
        for position in positions:
            if position is None:
                continue
            for token_id, logprob in position.items():
                if logprob.decoded_token is None:
                    logprob.decoded_token = self.token_decoder.decode_token(token_id)


def _default_model_format(config: EngineConfig) -> str:
    if config.default_model_format != "auto":
        return config.default_model_format
    return "float32" if resolve_device(config.device).type == "cuda" else "gguf"


def _eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    ids: list[int] = []
    path = Path(model_dir) / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.extend([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
