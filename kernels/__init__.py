"""Paged-attention kernels: Triton for CUDA, pure-torch references (the spec), a fast CPU path."""
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
