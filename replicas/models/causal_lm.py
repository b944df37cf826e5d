"""What every model class shares: the interface the model runner drives, the lm_head (tied or
not, soft-capped or not), the per-layer sliding windows, and loading HF-named checkpoint tensors
into our (partly fused) parameters.

A family's file builds `self.model` and calls `_init_lm_head`; where its parameter names differ
from the checkpoint's it overrides `checkpoint_sources` (and `convert` where a tensor must change
shape or values on the way in).
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

from pagedserve.kernels import cpu_linear
from pagedserve.kernels.backend import AttentionBackend, get_attention_backend
from pagedserve.kernels.metadata import AttentionMetadata, kv_cache_shape
from pagedserve.kernels.quantized import QuantWeight
from pagedserve.replicas.models.attention import layer_windows
from pagedserve.replicas.models.layers import (
    Embedding, Linear, materialize, pack_quantized, quantized_linear,
)
from pagedserve.replicas.models.rotary import RotaryEmbedding
from pagedserve.replicas.parallel import state as parallel_state
from pagedserve.replicas.parallel.sharding import (
    MIN_SHARD_GROUP, Shard, kv_heads_per_rank, read_shard,
)

logger = logging.getLogger(__name__)

# Tensors some checkpoints carry that are buffers, not weights: causal-mask biases (GPT-2,
# GPT-NeoX) and rotary frequencies.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                    "rotary_emb.inv_freq")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class CausalLM(nn.Module):
    """The decoder the model runner drives.

    model(input_ids [T], positions [T], kv_caches, attn_metadata) -> final hidden states [T, hidden]
    for all tokens of the step packed together; compute_logits(rows) -> logits in the model's dtype.
    kv_caches holds one tensor per layer, shaped [2, num_blocks, block_size, num_kv_heads, head_dim].
    sliding_windows[i] is layer i's attention window (None: full), max_context_len the longest
    context the model computes as trained.
    """

    checkpoint_prefix = "model."  # what a base-model checkpoint's names lack (e.g. OPT's "decoder.")
    lm_head_name = "lm_head.weight"  # the output embedding's name in checkpoints
    # A family that says how its checkpoint tensors shard (checkpoint_shard) sets it.
    supports_tensor_parallel = False
    # A family whose quantized weights shard by the same checkpoint_shard sets it: its convert()
    # at most reorders a projection's rows (convert_quantized), and its MoE / fused layers take
    # QuantWeight shards.
    supports_quantized_tensor_parallel = False

    def __init__(self, config, dtype: torch.dtype = torch.float32,
                 attention_backend: AttentionBackend | str = "auto",
                 device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        if isinstance(attention_backend, str):
            attention_backend = get_attention_backend(attention_backend, device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.attention_backend = attention_backend
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.vocab_size = config.vocab_size
        # This rank's share (all of it at tensor_parallel_size 1): its KV heads and vocab rows.
        self.tp = parallel_state.current()
        self.num_local_kv_heads = kv_heads_per_rank(self.num_kv_heads, self.tp.world_size)
        self.vocab_start, self.vocab_stop = self.tp.vocab_range(self.vocab_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.final_logit_soft_cap: float | None = None
        self.sliding_windows = layer_windows(config)  # the backend applies them: no cap at a window
        self.max_context_len = config.max_position_embeddings  # the rotary / position table's end
        self.tied_lm_head_packed = None  # cpu_linear's or pack_quantized's packing of a tied lm_head
        self.tied_lm_head_quantized = False

    def _init_lm_head(self, embedding: Embedding, in_features: int) -> None:
        self.lm_head = embedding if self.tie_word_embeddings else Linear(
            in_features, self.vocab_stop - self.vocab_start, False, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def set_max_model_len(self, requested: int | None) -> int:
        """The longest sequence the engine serves: the one requested (None: the longest there is),
        at most max_context_len, past which outputs would be wrong (sliding windows need no cap:
        the kernels apply them, and the block manager drops the blocks no layer's window
        reaches). Rotary tables that depend on it follow it (Phi-3's longrope factor set, picked
        once as vLLM does: see rotary.py). Returns it."""
        max_model_len = min(requested or self.max_context_len, self.max_context_len)
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.set_max_model_len(max_model_len)
        return max_model_len

    def pack_weights(self) -> None:
        """After loading, on CPU: every projection (and a tied lm_head) gets its packed weight."""
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.pack(name)
        for module in self.modules():  # modules that run their projections' packings together
            if hasattr(module, "combine_packed"):
                module.combine_packed()
        for module in self.modules():  # modules that plan their forward on the packed weights
            if hasattr(module, "after_packing"):
                module.after_packing()
        if self.tie_word_embeddings:  # the embedding keeps its rows for lookups
            quantized = self.lm_head.quantized
            self.tied_lm_head_quantized = quantized is not None
            self.tied_lm_head_packed = (cpu_linear.pack(self.lm_head.weight) if quantized is None
                                        else pack_quantized(quantized, self.device))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] in the model's dtype (under tensor parallelism: on rank 0,
        None elsewhere). Consumers widen what they compute on; greedy rows need only the argmax,
        which a bf16 row gives unwidened (widening keeps the order): widening a step's logits
        cost as much as the native argmax itself."""
        if self.tied_lm_head_quantized:
            logits = quantized_linear(hidden, self.tied_lm_head_packed)
        elif self.tie_word_embeddings:
            logits = cpu_linear.linear(hidden, self.lm_head.weight, self.tied_lm_head_packed)
        else:
            logits = self.lm_head(hidden)
        if self.tp.world_size > 1 and (logits := self.tp.gather_vocab(logits, self.vocab_size)) is None:
            return None
        if self.final_logit_soft_cap is not None:  # in the model dtype, as transformers does
            logits = torch.tanh(logits / self.final_logit_soft_cap) * self.final_logit_soft_cap
        return logits

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""
        return kv_cache_shape(num_blocks, block_size, self.num_local_kv_heads, self.head_dim)

    # -- checkpoint loading ------------------------------------------------------------------

    def checkpoint_sources(self, name: str) -> list[tuple[str, slice | None]]:
        """The checkpoint tensors our parameter `name` is made of, with the rows each one fills."""
        return [(self.lm_head_name if name == "lm_head.weight" else name, None)]

    def checkpoint_shard(self, hf_name: str, name: str) -> Shard | None:
        """The part of checkpoint tensor `hf_name` (loaded into our `name`) this rank holds;
        None: all of it. Only asked under tensor parallelism."""
        return None

    def convert(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as our parameter stores it (a transpose, a row order, an offset)."""
        return tensor

    def convert_quantized(self, hf_name: str, weight: QuantWeight) -> QuantWeight:
        """convert() for a quantized projection or embedding: the identity, unless the family's
        convert() changes such weights (then it says how to reorder rows, or refuses)."""
        if type(self).convert is CausalLM.convert:
            return weight
        # Ask convert() what it does to a column of row numbers: nothing, a row order (GPT-NeoX's
        # q/k/v), or a transpose (GPT-2's Conv1D), which a quantized layout cannot follow.
        probe = torch.arange(weight.shape[0], dtype=torch.float32).unsqueeze(1)
        moved = self.convert(hf_name, probe)
        if moved.shape != probe.shape:
            raise ValueError(f"{type(self).__name__} cannot load {hf_name!r} quantized: its "
                             "checkpoint layout is transposed on loading")
        return weight if torch.equal(moved, probe) else weight.rows(moved[:, 0].long())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
        """Copy HF-named tensors in, casting to the model dtype; fails on missing or unknown names.
        A QuantWeight goes to its projection or embedding whole (layers.py keeps it quantized)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        sources: dict[str, tuple[str, slice | None]] = {}
        for name in params:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for hf_name, rows in self.checkpoint_sources(name):
                sources[hf_name] = (name, rows)
        loaded: set[str] = set()
        dequantized: list[str] = []  # quantized shards whose groups the split cut too fine
        for hf_name, tensor in weights:
            if hf_name not in sources and self.checkpoint_prefix + hf_name in sources:
                hf_name = self.checkpoint_prefix + hf_name
            if hf_name not in sources:
                if hf_name.endswith(IGNORED_SUFFIXES):
                    continue
                if hf_name == self.lm_head_name and self.tie_word_embeddings:
                    continue  # tied checkpoints may still carry a copy of the embedding
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
            name, rows = sources[hf_name]
            param = params[name]
            if self.tp.world_size > 1:  # this rank's part only: a lazy slice reads only that
                quantized = is_quantized(tensor)
                tensor = read_shard(tensor, self.checkpoint_shard(hf_name, name))
                if quantized and not isinstance(tensor, QuantWeight):
                    dequantized.append(hf_name)
            if isinstance(tensor, QuantWeight):
                self._load_quantized(name, rows, self.convert_quantized(hf_name, tensor))
                loaded.add(hf_name)
                continue
            if param.is_meta:
                module_name, _, attribute = name.rpartition(".")
                param = params[name] = materialize(self.get_submodule(module_name), attribute, self.device)
            target = param.data if rows is None else param.data[rows]
            tensor = self.convert(hf_name, tensor)
            if target.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(hf_name)
        missing = sorted(set(sources) - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")
        if dequantized:
            logger.warning(
                "tensor_parallel_size=%d: %d quantized weight(s) are held dequantized, in %s, on "
                "rank %d (%s%s): their column shards cut the quantization groups into pieces "
                "finer than %d columns (act-order, or a group size that does not divide the "
                "shard); the values are exact, the memory is the dense one", self.tp.world_size,
                len(dequantized), str(self.dtype).removeprefix("torch."), self.tp.rank,
                ", ".join(dequantized[:3]), ", ..." if len(dequantized) > 3 else "",
                MIN_SHARD_GROUP)


    def _load_quantized(self, name: str, rows: slice | None, weight: QuantWeight) -> None:
        module_name, _, attribute = name.rpartition(".")
        module = self.get_submodule(module_name)
        if attribute != "weight" or not hasattr(module, "load_quantized"):
            raise ValueError(f"{name!r} came quantized, but only projection and embedding weights "
                             "can be")
        if rows is not None and weight.shape[0] != rows.stop - rows.start:
            raise ValueError(f"quantized {name!r} part has {weight.shape[0]} rows, expected "
                             f"{rows.stop - rows.start}")
        module.load_quantized(0 if rows is None else rows.start, weight)


def is_quantized(tensor) -> bool:
    """A QuantWeight, or a quantized checkpoint's lazy tensor (replicas/quant) that reads as one."""
    return isinstance(tensor, QuantWeight) or bool(getattr(tensor, "quantized", False))


def split_rows(sizes: list[int], names: list[str]) -> list[tuple[str, slice]]:
    """(name, rows) for checkpoint tensors stacked in this order into one fused parameter."""
    out, start = [], 0
    for name, size in zip(names, sizes):
        out.append((name, slice(start, start + size)))
        start += size
    return out
