"""Which part of a checkpoint tensor one tensor-parallel rank holds, reading only that part, and
the checks that a model can be split `tensor_parallel_size` ways at all (torch-free, so that a
deploy can run them).

Megatron-style, as vLLM: q/k/v and gate/up are column-parallel (each rank has its heads / its
share of the intermediate rows), o_proj and down_proj row-parallel (its share of the input
columns; their outputs are summed by one all-reduce each), the embedding and the lm_head split by
vocabulary rows. With fewer KV heads than ranks, each KV head is replicated on tp / kv ranks.

Quantized weights (pagedserve.kernels.quantized.QuantWeight, whatever their format) shard the same way: rows
exactly, columns by QuantWeight.columns, which splits a group the rank's range cuts into finer
groups. Where those would be finer than MIN_SHARD_GROUP the shard is dequantized instead (see
quant_shard).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

# The finest group a column shard stays quantized in: the Triton GEMM's smallest k tile, and
# where a group's float32 scale and offset already cost as much as its 4-bit values.
MIN_SHARD_GROUP = 16


@dataclass(frozen=True, slots=True)
class Shard:
    """Rows (dim 0) or columns (dim 1) of a checkpoint tensor, ranges concatenated in order;
    `zeros`: this rank holds zeros of the tensor's shape (a row-parallel bias is added once)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    zeros: bool = False


def row_parallel(tp, size: int, what: str, bias: bool, dim: int = 1) -> Shard | None:
    """A row-parallel projection's part on this rank (`tp`, a TensorParallel): its weight's share
    of the `size` input channels (dim 1; 0 for GPT-2's transposed Conv1D), and its bias whole on
    rank 0 and zeros elsewhere (the ranks' outputs are summed, so it must be added once)."""
    if bias:
        return None if tp.is_driver else Shard(zeros=True)
    return Shard(dim, (tp.split(size, what),))


def read_shard(source, shard: Shard | None):
    """`source` is a tensor, a safetensors slice (which reads only what is indexed), a
    QuantWeight, or a quantized checkpoint's lazy tensor (its `read_shard` reads only this
    rank's part where its format allows)."""
    import torch

    from pagedserve.kernels.quantized import QuantWeight
    if hasattr(source, "read_shard"):
        return source.read_shard(shard)
    if isinstance(source, QuantWeight):
        return quant_shard(source, shard)
    if shard is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    if shard.zeros:
        shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()
        dtype = source.dtype if isinstance(source, torch.Tensor) else torch.float32
        return torch.zeros(tuple(shape), dtype=dtype)
    index = (slice(None),) * shard.dim
    parts = [source[index + (slice(start, stop),)] for start, stop in shard.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)


def quant_shard(weight, shard: Shard | None):
    """A QuantWeight's rows or columns for this rank: a QuantWeight holding its own storage, or,
    where a column range cuts its groups into pieces finer than MIN_SHARD_GROUP, the exact float32
    value of the shard (the caller loads it dense, and says so)."""
    from pagedserve.kernels.quantized import cat_rows
    from pagedserve.kernels.reference import dequantize_weight
    if shard is None:
        return weight
    if shard.zeros:
        raise ValueError("a quantized weight cannot be a zero shard (only row-parallel biases are)")
    if shard.dim == 0:
        parts = [weight.rows(slice(start, stop)) for start, stop in shard.ranges]
        return parts[0].clone() if len(parts) == 1 else cat_rows(parts)
    if len(shard.ranges) != 1:
        raise ValueError("a quantized weight's column shard must be one range")
    part = weight.columns(*shard.ranges[0])
    if part.group_size != weight.group_size and part.group_size % MIN_SHARD_GROUP:
        return dequantize_weight(part)
    return part


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    return max(1, num_kv_heads // world_size)


def kv_head_start(num_kv_heads: int, world_size: int, rank: int) -> int:
    """First KV head of a rank; with fewer KV heads than ranks, each serves tp / kv ranks."""
    if num_kv_heads >= world_size:
        return rank * (num_kv_heads // world_size)
    return rank // (world_size // num_kv_heads)


def check_model_splits(model_dir, world_size: int) -> None:
    """The checkpoint in model_dir (its heads, its architecture) splits world_size ways: the app
    builder checks it before any replica starts, each engine again before it starts its ranks."""
    from pagedserve.replicas.models import get_model_class
    from pagedserve.replicas.models.loader import load_config
    from pagedserve.replicas.quant import quantization_of

    hf_config = load_config(model_dir)
    check_tensor_parallel(hf_config, world_size, get_model_class(hf_config),
                          quantized=quantization_of(model_dir) is not None)  # a GGUF's config says none


def check_tensor_parallel(hf_config, world_size: int, model_class: type,
                          quantized: bool | None = None) -> None:
    """ValueError naming both numbers where the model cannot be split `world_size` ways.
    quantized: whether the checkpoint is (None: whether its config has a quantization_config; a
    GGUF file's has none)."""
    if world_size == 1:
        return
    if not getattr(model_class, "supports_tensor_parallel", False):
        arch = (getattr(hf_config, "architectures", None) or [model_class.__name__])[0]
        raise ValueError(f"tensor_parallel_size > 1 is not supported for {arch} yet "
                         f"(got tensor_parallel_size={world_size})")
    if quantized is None:
        quantized = bool(getattr(hf_config, "quantization_config", None))
    # The model class says whether its quantized checkpoints shard as its float ones (GPT-2's
    # cannot load quantized at all).
    if quantized and not getattr(model_class, "supports_quantized_tensor_parallel", False):
        arch = (getattr(hf_config, "architectures", None) or [model_class.__name__])[0]
        raise ValueError(f"tensor_parallel_size > 1 is not supported for quantized {arch} "
                         f"checkpoints yet (got tensor_parallel_size={world_size})")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size ({world_size}) must divide the model's "
                         f"num_attention_heads ({heads})")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size ({world_size}) and the model's num_key_value_heads "
                         f"({kv_heads}) must divide one another")
    intermediate = getattr(hf_config, "intermediate_size", None)
    if intermediate and intermediate % world_size:
        raise ValueError(f"tensor_parallel_size ({world_size}) must divide the model's "
                         f"intermediate_size ({intermediate})")


def check_world_size(world_size: int, device_type: str, available: float | None = None) -> None:
    """ValueError naming both numbers when there are fewer devices (CPUs, GPUs) than ranks."""
    if world_size == 1:
        return
    if available is None:
        if device_type == "cuda":
            import torch
            available = torch.cuda.device_count()
        else:
            available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else os.cpu_count() or 1
    kind = "GPUs" if device_type == "cuda" else "CPUs"
    if world_size > available:
        raise ValueError(f"tensor_parallel_size ({world_size}) is more than the {kind} available "
                         f"({available:g})")
