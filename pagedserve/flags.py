"""The one mapping from command-line flags (vLLM's names where vLLM has the setting) to settings.

Both `pagedserve serve` and the README's configuration reference are built from it (through
`pagedserve.catalog`). The settings themselves are read from the pydantic models at run time, so
a setting added there gets a flag (`--its-name`) and a row in the reference with no change here;
an entry below only adds vLLM's spelling (and its units) for a setting, or a better one-line
meaning than the field's own comment.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

GIB = 2 ** 30


def human_int(text: str) -> int:
    """vLLM's human-readable integers: 1k = 1000, 1K = 1024 (likewise m/M, g/G)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text.strip())
    if not match:
        raise ValueError(f"expected an integer such as 2048, 2k or 2K, got {text!r}")
    number, unit = float(match[1]), match[2]
    power = "kmg".find(unit.lower()) + 1 if unit else 0
    return int(number * (1024 if unit.isupper() else 1000) ** power)


def bytes_to_gib(text: str) -> float:
    """vLLM's `--kv-cache-memory-bytes`: bytes, or a size with a unit (4GiB, 4G, 512MiB, 4g)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:([kKmMgGtT])(i?)[bB]?)?", text.strip())
    if not match:
        raise ValueError(f"expected a size such as 4GiB or 4294967296 (bytes), got {text!r}")
    number, unit, binary = float(match[1]), match[2], match[3]
    if not unit and number < 2 ** 20:  # "4" meant as GiB would silently give a 4-byte cache
        raise ValueError(f"{text!r} is in bytes, as in vLLM: write 4GiB, or --kv-cache-memory-gb 4")
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    base = 1024 if (binary or (unit and unit.isupper())) else 1000
    return number * base ** power / GIB


def vllm_dtype(text: str) -> str:
    return {"half": "float16", "float": "float32"}.get(text, text)


@dataclass(frozen=True)
class Flag:
    """vLLM's option strings for one setting, and how its values become the setting's."""

    setting: str
    vllm: tuple[str, ...]
    convert: Callable[[str], Any] | None = None  # vLLM's units -> the setting's
    note: str = ""  # how vLLM's values are written, for --help
    # The setting's own spelling (`--setting-name`, in its own units) is accepted too, unless
    # it is one of vLLM's names or `own=False`.
    own: bool = True
    many: bool = False  # several values after one flag, as vLLM's `--lora-modules a=x b=y`


VLLM_FLAGS: tuple[Flag, ...] = (
    Flag("model", ("--model",)),
    Flag("tokenizer", ("--tokenizer",)),
    Flag("served_model_name", ("--served-model-name",)),
    Flag("dtype", ("--dtype",), vllm_dtype),
    Flag("seed", ("--seed",)),
    Flag("max_model_len", ("--max-model-len",), human_int, "2k = 2000, 2K = 2048"),
    Flag("max_num_seqs", ("--max-num-seqs",), human_int),
    Flag("max_num_batched_tokens", ("--max-num-batched-tokens",), human_int,
         "2k = 2000, 2K = 2048"),
    Flag("block_size", ("--block-size",)),
    Flag("enable_prefix_caching", ("--enable-prefix-caching",)),
    Flag("enable_chunked_prefill", ("--enable-chunked-prefill",)),
    Flag("gpu_memory_utilization", ("--gpu-memory-utilization", "--device-memory-utilization")),
    Flag("kv_cache_memory_gb", ("--kv-cache-memory-bytes", "--kv-cache-memory"), bytes_to_gib,
         "bytes, or a size: 4GiB, 512MiB"),
    Flag("num_kv_blocks", ("--num-gpu-blocks-override",)),
    Flag("kv_cache_dtype", ("--kv-cache-dtype",)),
    Flag("scheduling_policy", ("--scheduling-policy",)),
    Flag("attention_backend", ("--attention-backend",)),
    Flag("max_logprobs", ("--max-logprobs",)),
    Flag("quantization", ("--quantization", "-q")),
    Flag("enable_lora", ("--enable-lora",)),
    Flag("lora_modules", ("--lora-modules",), many=True),
    Flag("max_loras", ("--max-loras",)),
    Flag("max_lora_rank", ("--max-lora-rank",)),
    Flag("max_cpu_loras", ("--max-cpu-loras",)),
    Flag("speculative_config", ("--speculative-config",), note="JSON, as in vLLM"),
    Flag("reasoning_parser", ("--reasoning-parser",)),
    Flag("api_keys", ("--api-key",), own=False),
    Flag("host", ("--host",)),
    Flag("port", ("--port",)),
    # vLLM's data parallelism is N engine copies behind one server: our replicas.
    Flag("num_replicas", ("--data-parallel-size", "-dp")),
    Flag("tensor_parallel_size", ("--tensor-parallel-size", "-tp")),
    Flag("distributed_executor_backend", ("--distributed-executor-backend",)),
)

# vLLM flags accepted at one value only, and why no other.
PINNED_VLLM_FLAGS: dict[tuple[str, ...], tuple[int, str]] = {
    ("--pipeline-parallel-size", "-pp"): (
        1, "one engine runs per device; scale out with --num-replicas"),
}

# vLLM flags for what pagedserve always does: accepted (a switch, or only the value given), ignored.
ALWAYS_ON_VLLM_FLAGS: dict[str, tuple[str | None, str]] = {
    "--enable-auto-tool-choice": (None, 'tool_choice "auto" is always available'),
    "--tool-call-parser": ("hermes", "calls are read as Hermes-style <tool_call> blocks or JSON"),
}

# vLLM flags people often carry over, and what to do instead. Any other unknown flag gets a
# generic one-line refusal.
UNSUPPORTED_VLLM_FLAGS: dict[str, str] = {
    "--trust-remote-code": "checkpoints load with pagedserve's own Llama/Mistral/Qwen2 code; "
                           "no remote code runs",
    "--revision": "models are local directories; nothing is downloaded",
    "--download-dir": "models are local directories; nothing is downloaded",
    "--hf-token": "models are local directories; nothing is downloaded",
    "--load-format": "the format is read from the checkpoint: a safetensors folder or a .gguf file",
    "--tokenizer-mode": "the checkpoint's fast tokenizer is always used",
    "--chat-template": "the checkpoint's own chat template is used",
    "--enforce-eager": "pagedserve does not capture CUDA graphs; there is nothing to turn off",
    "--swap-space": "preempted requests are recomputed, never swapped",
    "--cpu-offload-gb": "weights stay on the replica's device",
    "--reasoning-parser": "reasoning parsers are not implemented",
    "--disable-log-requests": "requests are not logged; --access-log turns Ray Serve's log on",
    "--enable-log-requests": "requests are not logged; --access-log turns Ray Serve's log on",
    "--disable-log-stats": "stats go to Prometheus (GET /metrics), not to the log",
    "--uvicorn-log-level": "the HTTP server logs warnings only; set RAY_SERVE_LOG_LEVEL instead",
    "--ssl-keyfile": "terminate TLS in front of Ray Serve (an ingress or load balancer)",
    "--ssl-certfile": "terminate TLS in front of Ray Serve (an ingress or load balancer)",
    "--root-path": "Ray Serve's http_options.root_path in a config file does this",
    "--config": "use `serve run serve_config.yaml` for a configuration file",
    "--generation-config": "sampling defaults come from the request",
    "--limit-mm-per-prompt": "only text models are served",
}

# One line of meaning per setting, where the field's own comment would not read well in a table.
MEANINGS: dict[str, str] = {
    "model": "Local HF-format checkpoint directory; none: the embedded SmolLM2-135M-Instruct",
    "tokenizer": "Tokenizer directory; none: the model's",
    "served_model_name": "The model id clients send and /v1/models lists; none: the model path",
    "dtype": ("Weights and compute dtype; auto: on CPU bf16 with AVX512-BF16 (quantized models: "
              "their activations), else float32; on GPU the checkpoint's"),
    "seed": "Seed for sampling when a request brings none",
    "block_size": "Tokens per KV-cache block (and per prefix-cache hash)",
    "max_model_len": "Longest prompt + output in tokens; none: the model's max_position_embeddings",
    "max_num_seqs": "Most sequences one replica runs in a batch",
    "max_num_batched_tokens": "Token budget of one engine step (prefill chunks + decodes)",
    "enable_prefix_caching": "Reuse KV blocks of identical prompt prefixes",
    "enable_chunked_prefill": "Split long prompts over steps under the token budget",
    "gpu_memory_utilization": "On CUDA: fraction of device memory for weights + KV cache",
    "kv_cache_memory_gb": "On CPU: KV-cache size per replica in GiB",
    "num_kv_blocks": "KV-cache size in blocks; overrides both sizes above",
    "device": "Where the engine runs; auto: CUDA when present, else CPU",
    "attention_backend": "Paged attention implementation: auto, torch (CPU), triton (CUDA), reference",
    "num_threads": "torch threads per engine (and Ray CPUs per CPU replica)",
    "cpu_bind": ("CPUs a served CPU replica's engine core runs on: auto (as many as its threads, "
                 "of those no other core on the node holds; the ingress and replica processes "
                 "keep off them), off, or a list such as 0-3 (vLLM-CPU's "
                 "VLLM_CPU_OMP_THREADS_BIND)"),
    "max_logprobs": "Most logprobs a request may ask for per token",
    "enable_lora": "Serve LoRA adapters on the base model (requests pick one with model=<name>)",
    "max_loras": "LoRA adapters one engine step can run: the slot pool's size",
    "max_lora_rank": "Largest LoRA rank; every slot is this wide",
    "max_cpu_loras": "LoRA adapters kept in memory per replica (LRU); none: max_loras",
    "speculative_config": ('Speculative decoding, e.g. {"method": "ngram", '
                           '"num_speculative_tokens": 4} or {"method": "suffix"}; none: off'),
    "reasoning_parser": ("A reasoning model's family (qwen3, deepseek_r1): its thinking in "
                         "reasoning_content, grammars applied after it"),
    "lora_modules": "LoRA adapters served from the start: name=path ...",
    "allow_runtime_lora_updating": ("POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                    "(also VLLM_ALLOW_RUNTIME_LORA_UPDATING)"),
    "api_keys": "Accepted bearer keys; empty: no auth (also PAGEDSERVE_API_KEYS)",
    "max_request_body_bytes": "Largest request body in bytes (413 beyond)",
    "max_prompts_per_request": "Most prompts in one completion request",
    "max_n": "Largest `n` (choices per request)",
    "max_stop_strings": "Most `stop` strings per request",
    "max_stop_string_chars": "Longest `stop` string in characters",
    "max_stop_token_ids": "Most `stop_token_ids` per request",
    "max_logit_bias_entries": "Most `logit_bias` entries per request",
    "max_messages": "Most chat messages per request",
    "max_prompt_chars": "Most prompt characters per request; none: 32 per token of max_model_len",
    "num_replicas": "Engine replicas (the start count when autoscaling)",
    "min_replicas": "Autoscaling lower bound; setting it or max_replicas turns autoscaling on",
    "max_replicas": "Autoscaling upper bound",
    "target_queue_depth": "Waiting requests per replica the autoscaler aims for",
    "upscale_delay_s": "Seconds above target before scaling up; none: the policy's default",
    "downscale_delay_s": "Seconds below target before scaling down; none: the policy's default",
    "replica_num_cpus": "Ray CPUs per engine replica; none: num_threads",
    "replica_num_gpus": "Ray GPUs per engine replica (1 on a GPU node)",
    "replica_max_ongoing_requests": "Requests one engine core holds at once (it refuses more); "
                                    "none: max_num_seqs",
    "max_queued_requests": "Requests waiting for room per ingress before 429 (-1: unbounded)",
    "retry_after_s": "Retry-After seconds on 429/503",
    "health_check_period_s": "Seconds between Ray Serve health checks of a replica",
    "health_check_timeout_s": "Seconds a health check may take",
    "engine_stall_timeout_s": "A replica with work that has not stepped this long reports unhealthy",
    "graceful_shutdown_timeout_s": "Seconds a stopping replica drains in-flight requests",
    "access_log": "Ray Serve's per-request access log lines",
    "host": "Address the HTTP API listens on (0.0.0.0: every interface)",
    "port": "Port of the HTTP API",
    "direct_http": "Ingress replicas serve HTTP themselves, no Ray Serve proxy; none: where "
                   "pagedserve starts Serve",
    "grpc_port": "Port of the ingress replicas' gRPC API on host (pagedserve.v1); none: no gRPC",
    "num_ingress_replicas": "Ingress (HTTP front) replicas",
    "ingress_num_cpus": "Ray CPUs per ingress replica",
    "ingress_max_ongoing_requests": "Requests one ingress replica takes at once (503 beyond)",
    "max_stream_events_per_s": "SSE events per second per ingress; none: measured; 0: no pacing",
    "max_stream_delay_s": "Longest pacing holds back a stream's tokens",
    "response_store_max_entries": "Stored Responses kept at most (least recently used go first)",
    "response_store_max_bytes": "Bytes of stored Responses kept at most",
    "response_store_ttl_s": "Seconds a stored Response is kept",
    "engine_process": "Each replica's engine steps in a process of its own (no GIL shared with "
                      "Ray Serve)",
    "engine_class": "Import path of an LLMEngine subclass for the engine core to run",
    "request_router_kwargs": "JSON settings of the ingress's prefix-affinity router",
    "autoscaling_policy": "Import path of an autoscaling policy; none: the queue-depth policy",
}
