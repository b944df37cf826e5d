"""EncoderEngine: embeddings from an encoder checkpoint (BERT family), one packed batch per call.

No KV cache and no scheduler: an encoder sees each text whole, in one forward pass, so a batch is
just the sequences that fit the token budget (`max_num_batched_tokens`, `max_num_seqs`), packed
without padding. Knows nothing of Ray or asyncio: the offline `LLM.embed` drives it directly, and an engine core
(`replicas/engine/core.py`) through `EncoderRequests`, which gives it the request surface of an
`LLMEngine`.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from pagedserve.replicas.config import EngineConfig
from pagedserve.replicas.models.loader import load_model, resolve_device
from pagedserve.replicas.core.pooling import PoolingConfig
from pagedserve.replicas.execution.pooler import pool
from pagedserve.replicas.core.outputs import RequestOutput
from pagedserve.replicas.core.sampling_params import ParamError

logger = logging.getLogger(__name__)

EmbedInput = str | list[int]


def sentence_transformers_max_len(model_dir: str | Path) -> int | None:
    """The max_seq_length a sentence-transformers directory was trained and is used with."""
    path = Path(model_dir) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("max_seq_length")


class EncoderEngine:
    """embed(inputs) -> float32 [len(inputs), hidden]; inputs are texts or token-id lists."""

    tasks = ("embed",)

    def __init__(self, config: EngineConfig, model_dir: str):
        from transformers import AutoTokenizer

        self.config = config
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or model_dir)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model, self.hf_config, self.dtype = load_model(
            model_dir, dtype=config.dtype, device=str(self.device))
        self.vocab_size = self.hf_config.vocab_size
        limits = [self.model.max_context_len, config.max_model_len,
                  sentence_transformers_max_len(model_dir)]
        self.max_model_len = min(limit for limit in limits if limit)
        self.pooling = PoolingConfig.from_model_dir(model_dir)
        self.model_name = config.served_model_name or config.model or Path(model_dir).name
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        # A sequence is never split across batches: the budget holds at least one whole one.
        self.max_num_batched_tokens = max(config.max_num_batched_tokens, self.max_model_len)
        self.num_steps = 0
        self.num_prompt_tokens = 0

    def tokenize(self, inputs: list[EmbedInput]) -> list[list[int]]:
        """Texts (special tokens added, as sentence-transformers does) and token-id lists ->
        checked token ids; a ParamError names `input` for an empty, over-long or bad one."""
        texts = [i for i, item in enumerate(inputs) if isinstance(item, str)]
        encoded = self.tokenizer([inputs[i] for i in texts])["input_ids"] if texts else []
        token_ids = [list(item) if not isinstance(item, str) else None for item in inputs]
        for i, ids in zip(texts, encoded):
            token_ids[i] = ids
        for ids in token_ids:
            self.check(ids)
        return token_ids

    def check(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ParamError("input", "an input is empty: it must contain at least one token")
        if len(token_ids) > self.max_model_len:
            raise ParamError("input", f"This model's maximum context length is {self.max_model_len} "
                             f"tokens. However, an input has {len(token_ids)} tokens. Please reduce "
                             "the length of the input.")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ParamError("input", f"token ids must be in [0, {self.vocab_size})")

    def batches(self, token_ids: list[list[int]]) -> list[tuple[int, int]]:
        """[start, end) ranges of consecutive sequences that fit one forward pass each."""
        ranges, start, num_tokens = [], 0, 0
        for i, ids in enumerate(token_ids):
            if i > start and (num_tokens + len(ids) > self.max_num_batched_tokens
                              or i - start >= self.max_num_seqs):
                ranges.append((start, i))
                start, num_tokens = i, 0
            num_tokens += len(ids)
        if start < len(token_ids):
            ranges.append((start, len(token_ids)))
        return ranges

    def embed(self, inputs: list[EmbedInput]) -> np.ndarray:
        token_ids = self.tokenize(inputs)
        parts = [self.embed_batch(token_ids[s:e]) for s, e in self.batches(token_ids)]
        return np.concatenate(parts) if parts else np.zeros((0, self.model.hidden_size), np.float32)

    @torch.inference_mode()
    def embed_batch(self, token_ids: list[list[int]]) -> np.ndarray:
        """Checked token ids of one batch -> [len(token_ids), hidden] float32 embeddings."""
        lengths = np.fromiter((len(ids) for ids in token_ids), dtype=np.int64, count=len(token_ids))
        seq_starts = np.zeros(len(token_ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=seq_starts[1:])
        num_tokens = int(seq_starts[-1])
        flat = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=num_tokens)
        positions = np.arange(num_tokens) - np.repeat(seq_starts[:-1], lengths)
        device = self.device
        starts = seq_starts.tolist()
        hidden = self.model(torch.from_numpy(flat).to(device), torch.from_numpy(positions).to(device),
                            starts)
        self.num_steps += 1
        self.num_prompt_tokens += num_tokens
        return pool(hidden, starts, self.pooling).cpu().numpy()

    def stats(self) -> dict:
        return {"num_waiting": 0, "num_running": 0, "num_requests": 0, "kv_cache_usage": 0.0,
                "prefix_cache_hit_rate": 0.0, "num_preemptions": 0, "num_steps": self.num_steps,
                "num_prompt_tokens": self.num_prompt_tokens, "num_generation_tokens": 0}


class EncoderRequests:
    """An EncoderEngine behind `LLMEngine`'s request surface (`make_request`, `add`,
    `abort_request`, `step`, `stats`), so an engine core serves it as it serves a decoder: each
    step embeds the requests that fit one forward pass, in arrival order, and each request's one
    output carries its embedding."""

    tasks = ("embed",)

    def __init__(self, encoder: EncoderEngine):
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.model_name = encoder.model_name
        self.max_model_len = encoder.max_model_len
        self.block_size = encoder.block_size
        self.vocab_size = encoder.vocab_size
        self.requests: dict[str, list[int]] = {}  # in arrival order
        self.num_arrived = 0
        self.num_generation_tokens = 0  # embeddings made: the core's proof that it serves

    def make_request(self, request_id: str, prompt: dict, params=None, priority: int = 0,
                     lora_request=None):
        if lora_request is not None:
            raise ParamError("model", "LoRA adapters apply to the generation model, not to this "
                             "embedding model")
        token_ids = list(prompt["prompt_token_ids"])
        self.encoder.check(token_ids)
        return request_id, token_ids

    def add(self, request: tuple[str, list[int]]) -> None:
        request_id, token_ids = request
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.requests[request_id] = token_ids
        self.num_arrived += 1

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        request_ids = list(self.requests)
        token_ids = [self.requests[r] for r in request_ids]
        start, end = self.encoder.batches(token_ids)[0]
        rows = self.encoder.embed_batch(token_ids[start:end])
        now = time.monotonic()
        outputs = []
        for request_id, ids, row in zip(request_ids[start:end], token_ids[start:end], rows):
            del self.requests[request_id]
            outputs.append(RequestOutput(request_id, None, [], [], finished=True,
                                         num_prompt_tokens=len(ids), embedding=row.tolist(),
                                         metrics={"arrival_time": now, "first_token_time": now,
                                                  "finish_time": now, "num_generated_tokens": 0}))
        self.num_generation_tokens += len(outputs)
        return outputs

    def take_failures(self) -> list:
        return []

    def stats(self) -> dict:
        return {**self.encoder.stats(), "num_waiting": len(self.requests),
                "num_requests": len(self.requests), "num_arrived": self.num_arrived}
