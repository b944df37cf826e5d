"""Triton weight-only dequant-GEMM (W4A16 / W8A16): y = x . dequantize_weight(weight)^T (+ bias).

A pagedserve.kernels.quantized.QuantWeight is packed once, at load, by pack(); linear() runs it on
activations of any float dtype (fp16, bf16, fp32), accumulating in fp32, output in x's dtype.
kernels/reference.py's quant_linear is the spec.

Why this layout (PackedWeight):
- qweight is int32 [k * bits / 32, n]: each word holds 32 / bits consecutive values along k
  (value j of a word in bits j*bits .. j*bits + bits - 1), and consecutive words along n are
  adjacent in memory. A program's tile of BLOCK_K x BLOCK_N values is then BLOCK_N-wide coalesced
  loads of whole words, unpacked with one shift and one mask, and 4 bits cost exactly 4 bits.
- scales and offsets are float32 [k / group_size, n]: one row per group, coalesced along n like
  the words. They stay float32 because offsets carry the zero point (Q8_0's is -128 * d, GPTQ's
  -z * s), which cancels against s * q: an fp16 offset of -128 * d is off by up to d / 16, a
  sixteenth of a quantization step the fp32 spec does not have. At groups of 128 they add 8 bytes
  per 64 bytes of 4-bit weights; a program reads each group's row once per k tile.
- The kernel never materializes the dequantized weight. BLOCK_K divides group_size, so a k tile
  sits in one group and, per output column, sum_k x_k (s q_k + o) = s * (x . q) + o * sum_k x_k:
  q (integers below 256, exact in fp16 and bf16) goes straight into tl.dot with x in its own
  dtype (tensor cores, fp32 accumulation), then one multiply-add per tile applies the group's
  scale and offset. No rounding of the weight to 16 bits, so fp16 results match the fp32 spec
  up to the output's own rounding.
- perm (GPTQ act-order) is applied to x once per call (x[:, perm]), so the weight stays in stored
  order and every group stays contiguous along k.

Block sizes come from the number of rows M: decode (M <= 16) uses 16-row tiles and splits k over
more programs when the grid would leave SMs idle (partial sums in fp32, added in a fixed order, so
results do not depend on timing); prefill uses 64- or 128-row tiles. Under TRITON_INTERPRET=1
(tests on CPU) the dots run in fp32, whose interpreter arithmetic is right (bf16's is not).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quantized import QuantWeight

MIN_BLOCK_K = 16  # tl.dot's smallest K
# Split-K: below this many programs the GPU has idle SMs; each split keeps at least this much of k.
MIN_SPLIT_K = 256
MAX_SPLITS = 16


@dataclass(frozen=True)
class PackedWeight:
    """A QuantWeight in the Triton kernel's layout (see the module docstring), on one device."""
    bits: int
    group_size: int
    qweight: torch.Tensor  # int32 [k * bits // 32, n]
    scales: torch.Tensor  # float32 [k // group_size, n]
    offsets: torch.Tensor  # float32 [k // group_size, n]
    perm: torch.Tensor | None  # int64 [k]: stored column -> input channel

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features n, in_features k)."""
        return self.qweight.shape[1], self.qweight.shape[0] * 32 // self.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.offsets))


@dataclass(frozen=True, slots=True)
class _Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pack(weight: QuantWeight, device: torch.device | str) -> PackedWeight:
    """QuantWeight -> PackedWeight on `device`. group_size must be a multiple of 16 (tl.dot's
    smallest k tile), which every supported format's groups are (GGUF 16/32, GPTQ/AWQ 32-128,
    per-channel over a k that is)."""
    n, k = weight.shape
    if weight.group_size % MIN_BLOCK_K:
        raise ValueError(f"the Triton quantized GEMM needs group_size a multiple of {MIN_BLOCK_K}, "
                         f"got {weight.group_size}")
    per_word = 32 // weight.bits
    values = weight.values().to(torch.int64).view(n, k // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * weight.bits
    words = (values << shifts).sum(-1)  # < 2**32, exact in int64
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits
    perm = None if weight.perm is None else weight.perm.to(device=device, dtype=torch.int64)
    return PackedWeight(weight.bits, weight.group_size, words.T.contiguous().to(device),
                        weight.scales.T.contiguous().to(device), weight.offsets.T.contiguous().to(device),
                        perm)


@triton.jit
def quant_matmul_kernel(out_ptr, x_ptr, qweight_ptr, scales_ptr, offsets_ptr, bias_ptr,
                        M, N, K, group_size, stride_x_row, stride_out_split, stride_out_row,
                        BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits). One program: a BLOCK_M x BLOCK_N tile of
    the output over its share of k. Without SPLIT (one split) it writes the output, bias added, in
    out's dtype; with SPLIT, split i writes its fp32 partial sum at out_ptr + i * stride_out_split
    and no bias. The split count is the grid's, so it costs no recompilation."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    kk = tl.arange(0, BLOCK_K)
    # Word row and bit position of each value of a k tile (BLOCK_K is a multiple of 32 // BITS).
    word_rows = kk // (32 // BITS)
    shifts = ((kk % (32 // BITS)) * BITS)[:, None]

    num_tiles = K // BLOCK_K  # BLOCK_K divides group_size, which divides K: no ragged k tile
    tiles_per_split = tl.cdiv(num_tiles, tl.num_programs(2))
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x_row + kk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in range(first_tile, last_tile):
        k0 = tile * BLOCK_K
        x = tl.load(x_ptrs + k0, mask=row_mask[:, None], other=0.0)
        x_sum = tl.sum(x.to(tl.float32), 1)
        words = tl.load(qweight_ptr + (k0 // (32 // BITS) + word_rows)[:, None] * N + cols[None, :],
                        mask=col_mask[None, :], other=0)
        q = (words >> shifts) & ((1 << BITS) - 1)
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * N + cols, mask=col_mask, other=0.0)
        offset = tl.load(offsets_ptr + group * N + cols, mask=col_mask, other=0.0)
        dot = tl.dot(x.to(COMPUTE_DTYPE), q.to(COMPUTE_DTYPE), input_precision=PRECISION)
        acc += dot * scale[None, :] + x_sum[:, None] * offset[None, :]

    out_mask = row_mask[:, None] & col_mask[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out_row + cols[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs + split * stride_out_split, acc, mask=out_mask)


def _launch(kernel, grid, *args, **meta) -> None:
    """The one place the kernel starts, so tests can record launches (and compile them for a GPU)."""
    kernel[grid](*args, **meta)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_COMPUTE_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _dot_dtype(x: torch.Tensor):
    """(tl.dot input dtype, input precision): x's own 16-bit dtype on a GPU, else fp32 with IEEE
    precision (not TF32: the spec is fp32)."""
    if _interpreting() or x.dtype not in _COMPUTE_DTYPES:
        return tl.float32, "ieee"
    return _COMPUTE_DTYPES[x.dtype], "ieee"  # precision only matters for fp32 inputs


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number keeps the heuristic testable
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_k(group_size: int, target: int) -> int:
    """The largest power of two <= target that divides group_size (at least MIN_BLOCK_K)."""
    block = target
    while group_size % block:
        block //= 2
    return block


def choose_config(num_rows: int, group_size: int) -> _Config:
    """Tiles by M bucket: decode reads each weight tile for few rows (memory-bound: wide k tiles,
    few warps); prefill reuses each weight tile over many rows (compute-bound: big square tiles)."""
    if num_rows <= 16:
        return _Config(16, 64, _block_k(group_size, 128), num_warps=4, num_stages=3)
    if num_rows <= 64:
        return _Config(64, 64, _block_k(group_size, 64), num_warps=4, num_stages=3)
    return _Config(128, 128, _block_k(group_size, 64), num_warps=8, num_stages=3)


def choose_num_splits(num_rows: int, n: int, k: int, config: _Config, device: torch.device) -> int:
    """Split-K factor: 1 unless the (M, N) grid would leave SMs idle."""
    programs = triton.cdiv(num_rows, config.block_m) * triton.cdiv(n, config.block_n)
    num_sms = _num_sms(device)
    if programs >= num_sms:
        return 1
    by_length = k // max(MIN_SPLIT_K, config.block_k)
    return max(1, min(triton.cdiv(2 * num_sms, programs), by_length, MAX_SPLITS))


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None, *,
           num_splits: int | None = None) -> torch.Tensor:
    """x [..., k] -> x . W^T (+ bias) [..., n] in x's dtype, accumulated in fp32.

    num_splits forces the split-K factor (1: none); None lets choose_num_splits decide.
    """
    n, k = packed.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    lead = x.shape[:-1]
    x = x.reshape(-1, k)
    if packed.perm is not None:
        x = x.index_select(1, packed.perm)  # once per call: the kernel reads stored order
    if x.stride(1) != 1:
        x = x.contiguous()
    num_rows = x.shape[0]
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out.view(*lead, n)
    config = choose_config(num_rows, packed.group_size)
    splits = num_splits or choose_num_splits(num_rows, n, k, config, x.device)
    splits = min(splits, k // config.block_k)
    compute_dtype, precision = _dot_dtype(x)
    target = out if splits == 1 else torch.empty(splits, num_rows, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_rows, config.block_m), triton.cdiv(n, config.block_n), splits)
    _launch(quant_matmul_kernel, grid,
            target, x, packed.qweight, packed.scales, packed.offsets, out if bias is None else bias,
            num_rows, n, k, packed.group_size, x.stride(0), target.stride(0) if splits > 1 else 0,
            target.stride(-2), BITS=packed.bits, HAS_BIAS=bias is not None,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT=splits > 1,
            COMPUTE_DTYPE=compute_dtype, PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        total = target.sum(0)  # a fixed order: results do not depend on which split ends first
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out.view(*lead, n)
