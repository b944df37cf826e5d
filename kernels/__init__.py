"""Paged-attention kernels: Triton for CUDA, pure-torch references (the spec), a fast CPU path."""
from kernels.metadata import AttentionMetadata, kv_cache_bytes_per_block, kv_cache_shape

__all__ = ["AttentionMetadata", "kv_cache_bytes_per_block", "kv_cache_shape"]
