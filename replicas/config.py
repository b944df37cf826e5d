"""Engine settings: one pydantic model, vLLM-compatible names, defaults in one place."""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.replicas.core.reasoning import ReasoningParserName
from pagedserve.replicas.engine import cpu_binding

DEFAULTS = dict(
    block_size=16,
    max_num_seqs=64,
    max_num_batched_tokens=1024,
    kv_cache_memory_gb=1.0,
    gpu_memory_utilization=0.9,
)


# vLLM's speculative methods this engine does not run yet.
_UNBUILT_SPEC_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator")


class SpeculativeConfig(BaseModel):
    """vLLM's `speculative_config`, for the methods built here: "ngram" (prompt lookup: drafts
    copied from where the sequence's last n tokens appeared before) and "suffix" (suffix
    decoding over the prompt and recent requests' outputs); neither needs a second model."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["ngram", "suffix"] = "ngram"
    # Drafts proposed per sequence and step, at most. Required for ngram; suffix: its
    # max_tree_depth, as in vLLM.
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    # ngram: the n-grams looked up, longest first. Unset, as in vLLM: both 5, or each the other.
    prompt_lookup_min: int | None = Field(None, ge=1)
    prompt_lookup_max: int | None = Field(None, ge=1)
    # suffix: how far back a match and its draft reach together; the requests whose outputs are
    # kept to draft from (a smaller default than vLLM's: the index lives in Python objects); a
    # draft's length at most this times its match's; its tokens' least estimated probability.
    suffix_decoding_max_tree_depth: int = Field(24, ge=2, le=64)
    suffix_decoding_max_cached_requests: int = Field(1000, ge=0)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)
    # No drafts in a step whose batch holds more running sequences than this: the verify rows
    # cost compute a busy step lacks. None: the measured default (replicas/spec/speculator.py).
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _name_unbuilt(cls, data):
        if isinstance(data, dict):
            method = data.get("method")
            if data.get("model") is not None or method in _UNBUILT_SPEC_METHODS:
                what = f"method {method!r}" if method in _UNBUILT_SPEC_METHODS else "a draft model"
                raise ValueError(f"speculative_config: {what} is not supported yet; use "
                                 "{\"method\": \"ngram\" or \"suffix\", ...}")
        return data

    @model_validator(mode="after")
    def _defaults(self) -> "SpeculativeConfig":
        if self.method == "suffix":
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = min(self.suffix_decoding_max_tree_depth, 64)
            return self
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config: num_speculative_tokens is required for ngram")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min must be at most prompt_lookup_max")
        return self


class EngineConfig(BaseModel):
    """Everything an engine replica (or the offline `LLM`) needs to start."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None  # a local HF-format directory; None: the embedded default model
    tokenizer: str | None = None  # defaults to `model`
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Weight-only quantization of the checkpoint (vLLM's name and values); None: what the
    # checkpoint says (a .gguf file, or config.json's quantization_config). Given, it must agree.
    quantization: Literal["gguf", "gptq", "awq", "compressed-tensors"] | None = None
    # The embedded default model (model None) as its package ships it, Q4_1 weights on the
    # quantized kernels ("gguf"), or converted once to float32 safetensors ("float32"). auto:
    # gguf on CPU, where it runs faster (bench/quantized.py), float32 on CUDA. Where auto runs the
    # conversion in bf16 (AVX512-BF16) it is a trade: GGUF is faster at batch 1, bf16 at large
    # batches.
    default_model_format: Literal["auto", "gguf", "float32"] = "auto"
    # The paged KV cache's dtype; auto: the model's (kernels/torch_attention.py casts on store and load).
    kv_cache_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    seed: int = 0
    block_size: int = Field(DEFAULTS["block_size"], ge=1, le=256)
    max_model_len: int | None = Field(None, ge=1)  # None: the model's max_position_embeddings
    max_num_seqs: int = Field(DEFAULTS["max_num_seqs"], ge=1)
    max_num_batched_tokens: int = Field(DEFAULTS["max_num_batched_tokens"], ge=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "fcfs": arrival order; "priority": each request's `priority` first (lower sooner), then
    # arrival, for admission and preemption alike (vLLM's policies).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # KV cache size: CUDA uses a fraction of device memory; CPU a size in GiB. num_kv_blocks wins.
    gpu_memory_utilization: float = Field(DEFAULTS["gpu_memory_utilization"], gt=0.0, le=1.0)
    kv_cache_memory_gb: float = Field(DEFAULTS["kv_cache_memory_gb"], gt=0.0)
    num_kv_blocks: int | None = Field(None, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention_backend: Literal["auto", "torch", "triton", "reference"] = "auto"
    num_threads: int | None = Field(None, ge=1)  # torch intra-op threads on CPU; None: leave as is
    # The CPUs a served replica's engine core runs on (replicas/engine/cpu_binding.py; vLLM-CPU's
    # VLLM_CPU_OMP_THREADS_BIND): "auto" (CPUs no other core on the node holds, on CPU devices),
    # "off", or a list such as "0-3". The offline LLM runs in the caller's process and leaves its
    # affinity alone, as does a tensor-parallel replica (its engine steps in the replica's process).
    cpu_bind: str = "auto"
    # Ranks one replica's model is split over (vLLM's name): heads, MLP rows and vocabulary are
    # sharded (replicas/parallel); on CPU each rank gets num_threads / tensor_parallel_size threads.
    tensor_parallel_size: int = Field(1, ge=1)
    # How the other ranks start: "mp" local processes, "ray" actors in the replica's placement
    # group; auto: ray where Ray is running (a Serve replica), mp otherwise.
    distributed_executor_backend: Literal["auto", "mp", "ray"] = "auto"
    max_logprobs: int = Field(20, ge=0)
    # A decoder that also answers embeddings: its final hidden states pooled at the last token or
    # averaged (then normalized). None: it only generates. Encoders pool as their checkpoint says.
    pooling: Literal["last", "mean"] | None = None
    # LoRA adapters on the base model (vLLM's names): max_loras adapters can run in one step, each
    # in a slot of a pool sized by max_lora_rank; max_cpu_loras are kept loaded in memory (None:
    # max_loras), the least recently used dropped past it.
    enable_lora: bool = False
    max_loras: int = Field(1, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    max_cpu_loras: int | None = Field(None, ge=1)
    # Speculative decoding (vLLM's speculative_config, a dict or its JSON): e.g. {"method":
    # "ngram", "num_speculative_tokens": 4}. None: off.
    speculative_config: SpeculativeConfig | None = None
    # A reasoning model's family (vLLM's reasoning_parser): a grammar waits for the end of the
    # thinking, and the ingress splits the thinking into `reasoning_content`. None: plain text.
    reasoning_parser: ReasoningParserName | None = None

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative_config(cls, value):
        if isinstance(value, str):  # `serve run ... speculative_config='{...}'` and the CLI
            try:
                return json.loads(value) if value.strip() not in ("", "null", "None") else None
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc}") from None
        return value

    @field_validator("cpu_bind")
    @classmethod
    def _check_cpu_bind(cls, value: str) -> str:
        return cpu_binding.check_spec(value)

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens must be >= max_model_len without chunked prefill")
        if self.cpu_bind not in ("auto", "off") and self.tensor_parallel_size > 1:
            raise ValueError("cpu_bind: a CPU list binds one process; tensor-parallel ranks are "
                             "separate processes (use auto or off)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora: LoRA adapters are not sharded across tensor-parallel "
                             "ranks yet (use tensor_parallel_size 1)")
        return self
