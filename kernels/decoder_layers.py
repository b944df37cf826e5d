"""A step through a stack of Llama-style decoder layers in one native call
(csrc/decoder_layers.c): the same kernels, arguments and order as the model's Python forward
(replicas/models/llama.py), so the outputs are bit for bit the same; what goes is the Python
between them, a large share of a batch-1 decode step of the default model (module calls,
per-kernel argument checks, result tensors; bench/decode_stack.py measures it).

It takes layers whose projections are all packed for the native GEMMs (weight-only quantized
panels: GGUF, GPTQ without act-order, AWQ, compressed-tensors; fp32 or bf16 panels), fp32 or bf16
activations, RMSNorms, rotary attention without a window or soft cap, and a SiLU gated MLP; steps
where every sequence decodes, and, where the native prefill attention takes the head_dim (a
multiple of 16, as the layer loop's attention needs for the same kernel), steps with prefills
too: under streaming load most steps carry a new prompt's chunk beside the decodes.
DecoderStack.build returns None for anything else (oneDNN-packed or unpacked weights among
them), and the caller keeps its layer loop.

With LoRA adapters (`set_lora`), a step whose rows run adapters goes through it too: each
projection's rows get their adapters' deltas right after its GEMM (csrc/lora.c), as the layer
loop's projections add them.

PAGEDSERVE_FUSED_DECODE=0 keeps the layer loop (comparisons, benchmarks).
"""
from __future__ import annotations

import array
import os
from typing import NamedTuple

import torch

from pagedserve.kernels import native, native_attention, native_linear, native_norm_act
from pagedserve.kernels.cpu_linear import PackedWeight
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.quant_linear import _BF16_BIAS, _BF16_OUT, _BF16_X, PackedQuant

ENV = "PAGEDSERVE_FUSED_DECODE"

# csrc/decoder_layers.c's row layouts, field for field.
_PROJ_FIELDS = 7  # kind, weight (or q), so, bias, dtypes, bits, group size
_QUANT, _FP32, _BF16 = range(3)  # the kinds: csrc/gemm_q.c, csrc/gemm.c, csrc/gemm_bf16.c
_LAYER_FIELDS = 2 + 4 * _PROJ_FIELDS  # input norm, post norm, then qkv, o, gate_up, down
(_LAYERS, _TOKENS, _SEQS, _TABLE_WIDTH, _HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _ROTARY_HALF,
 _CS_STRIDE, _INTER, _NUM_BLOCKS, _BLOCK_SIZE, _NORM_DTYPES, _DATA_DTYPES, _STEP_FIELDS) = range(16)
_DTYPES = (torch.float32, torch.bfloat16)
# csrc/decoder_layers.c's LoRA table: a header, then per layer and projection three parts.
_LH_TOKEN_SLOTS, _LH_SLOTS, _LH_RANK, _LH_DTYPES, _LH_FIELDS = range(5)
_LORA_PARTS, _LP_FIELDS = 3, 5  # a part: A, B^T, ranks, n, first output column


class LoRAPart(NamedTuple):
    """One part of a projection's LoRA slots (replicas/lora/slots.py): A [slots, rank, k], B^T
    [slots, rank, n], ranks int32 [slots], and the part's first output column."""
    lora_a: torch.Tensor
    lora_b_t: torch.Tensor
    ranks: torch.Tensor
    offset: int


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class Projection(NamedTuple):
    packed: PackedQuant | PackedWeight
    bias: torch.Tensor | None


class LayerWeights(NamedTuple):
    """One decoder layer's weights, as csrc/decoder_layers.c applies them."""
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection


def _address(a: array.array) -> int:
    return a.buffer_info()[0]


class DecoderStack:
    """The layers' weights as the kernel reads them, built once after packing."""

    def __init__(self, layers: list[LayerWeights], *, dtype: torch.dtype, hidden_size: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, scale: float):
        self._keep = layers  # the tensors behind the pointers
        self.dtype, self.eps, self.scale = dtype, eps, scale
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim, self.intermediate_size = head_dim, intermediate_size
        self.takes_prefills = native_attention.supports_prefill(head_dim)
        # csrc/decoder_layers.c's per-token scratch: qkv, attention output, gate_up, activation
        self.scratch_width = (2 * num_heads + 2 * num_kv_heads) * head_dim + 3 * intermediate_size
        data = _BF16_OUT | _BF16_X if dtype is torch.bfloat16 else 0  # the same bits in every GEMM
        rows = []
        for layer in layers:
            row = [layer.input_norm.data_ptr(), layer.post_norm.data_ptr()]
            for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
                packed, bias = proj.packed, proj.bias
                bias_bits = _BF16_BIAS if bias is not None and bias.dtype is torch.bfloat16 else 0
                bias_ptr = 0 if bias is None else bias.data_ptr()
                if isinstance(packed, PackedQuant):
                    _, q, so, so_bits = packed.args
                    row += [_QUANT, q, so, bias_ptr, data | bias_bits | so_bits, packed.bits, packed.group_size]
                elif packed.kind == "native":
                    row += [_FP32, packed.tensor.data_ptr(), 0, bias_ptr, 0, 0, 0]
                else:  # the tile the layer's own calls use (chosen once per process)
                    widen = native_linear._BF16_WIDEN if native_linear.bf16_tile() == "widen" else 0
                    row += [_BF16, packed.tensor.data_ptr(), 0, bias_ptr, data | bias_bits | widen, 0, 0]
            rows += row
        self._layers = array.array("q", rows)
        self._step = array.array("q", [0] * _STEP_FIELDS)
        step = self._step
        step[_LAYERS], step[_HIDDEN], step[_HEADS] = len(layers), hidden_size, num_heads
        step[_KV_HEADS], step[_HEAD_DIM], step[_INTER] = num_kv_heads, head_dim, intermediate_size
        step[_NORM_DTYPES] = native_norm_act.norm_dtypes(dtype, layers[0].input_norm.dtype)
        self._kv_list: list[torch.Tensor] | None = None
        self._kv = array.array("q", [0] * len(layers))
        self._kv_bf16 = 0
        self._lora: array.array | None = None  # set_lora's table
        self._lora_keep: list | None = None

    def set_lora(self, layers: list[list[list[LoRAPart]]]) -> bool:
        """Each layer's qkv, o, gate_up and down LoRA parts (at most three each, one slot pool):
        steps with adapter rows then run here too. False (and no change) where the kernel
        cannot take them."""
        first = layers[0][0][0] if layers and layers[0] and layers[0][0] else None
        if first is None or len(layers) != len(self._kv):
            return False
        num_slots, rank = first.lora_a.shape[:2]
        weight_dtype = first.lora_a.dtype
        rows = [0, num_slots, rank, native.BF16_WEIGHT if weight_dtype is torch.bfloat16 else 0]
        for projections in layers:
            if len(projections) != 4:
                return False
            for parts in projections:
                if len(parts) > _LORA_PARTS:
                    return False
                for part in parts:
                    a, b_t, ranks = part.lora_a, part.lora_b_t, part.ranks
                    if not (a.dtype is weight_dtype and b_t.dtype is weight_dtype and a.is_cpu
                            and a.is_contiguous() and b_t.is_contiguous()
                            and a.shape[:2] == (num_slots, rank) and b_t.shape[:2] == (num_slots, rank)
                            and ranks.dtype is torch.int32 and ranks.shape == (num_slots,)):
                        return False
                    rows += [a.data_ptr(), b_t.data_ptr(), ranks.data_ptr(), b_t.shape[2], part.offset]
                rows += [0] * (_LP_FIELDS * (_LORA_PARTS - len(parts)))
        self._lora = array.array("q", rows)
        self._lora_keep = layers
        return True

    @classmethod
    def build(cls, layers: list[LayerWeights], *, dtype: torch.dtype, **shape) -> "DecoderStack | None":
        """The stack, or None where the kernel does not take these weights (see the module doc)."""
        if not (layers and enabled() and dtype in _DTYPES and native.available()):
            return None
        hidden, inter = shape["hidden_size"], shape["intermediate_size"]
        q_size = shape["num_heads"] * shape["head_dim"]
        widths = {"qkv": (q_size + 2 * shape["num_kv_heads"] * shape["head_dim"], hidden),
                  "o": (hidden, q_size), "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        norm_dtype = layers[0].input_norm.dtype
        if native_norm_act.norm_dtypes(dtype, norm_dtype) is None:
            return None
        for layer in layers:
            for norm in (layer.input_norm, layer.post_norm):
                if not (norm.dtype is norm_dtype and norm.is_cpu and norm.is_contiguous()
                        and norm.shape == (hidden,)):
                    return None
            for name, (n, k) in widths.items():
                proj = getattr(layer, name)
                if not _takes(proj.packed, dtype, n, k):
                    return None
                bias = proj.bias
                fp32_only = isinstance(proj.packed, PackedWeight) and proj.packed.kind == "native"
                if bias is not None and not (bias.dtype in ((torch.float32,) if fp32_only else _DTYPES)
                                             and bias.is_cpu and bias.is_contiguous() and bias.shape == (n,)):
                    return None
        return cls(layers, dtype=dtype, **shape)

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> bool:
        """Reads the caches' pointers and shape once per list of caches (the runner allocates its
        list once and never changes it); False if the kernel cannot read them."""
        first = kv_caches[0] if len(kv_caches) == len(self._kv) else None
        if first is None or first.dim() != 5:
            return False
        shape, dtype = first.shape, first.dtype
        if not (dtype in _DTYPES and shape[0] == 2 and shape[3:] == (self.num_kv_heads, self.head_dim)):
            return False
        for i, cache in enumerate(kv_caches):
            if not (cache.shape == shape and cache.dtype is dtype and cache.is_cpu and cache.is_contiguous()):
                return False
            self._kv[i] = cache.data_ptr()
        self._step[_NUM_BLOCKS], self._step[_BLOCK_SIZE] = shape[1], shape[2]
        self._kv_bf16 = native.BF16_KV if dtype is torch.bfloat16 else 0
        self._kv_list = kv_caches
        return True

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
            token_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layers over hidden [T, hidden] (the embeddings; taken over and written) for a
        step: (the last layer's MLP output, the residual stream before it), what the layer loop
        returns; None (nothing done) where these operands are not the kernel's. token_slots:
        each row's LoRA slot (int32 [T], -1: none), or None when no row runs an adapter."""
        if kv_caches is not self._kv_list and not self._bind_caches(kv_caches):
            return None
        tokens = hidden.shape[0] if hidden.dim() == 2 else -1
        lora = 0
        if token_slots is not None:
            if self._lora is None or not _index(token_slots, torch.int32, (tokens,)):
                return None
            self._lora[_LH_TOKEN_SLOTS] = token_slots.data_ptr()
            lora = _address(self._lora)
        batch = metadata.num_seqs
        tables, slots = metadata.block_tables, metadata.slot_mapping
        width = tables.shape[-1] if tables.dim() == 2 else -1
        half = cos.shape[-1]
        cs_stride = cos.stride(0) if cos.dim() else 0
        if not ((metadata.is_all_decode and tokens == batch or self.takes_prefills and tokens >= batch)
                and hidden.dtype is self.dtype and hidden.is_contiguous()
                and hidden.shape[1] == self.hidden_size and cos.dtype is self.dtype
                and sin.dtype is self.dtype and cos.shape == sin.shape and cos.shape[0] == tokens
                and cos.numel() == tokens * half and 2 * half <= self.head_dim
                and cos.stride(-1) == 1 and sin.stride(-1) == 1 and sin.stride(0) == cs_stride
                and _index(tables, torch.int32, (batch, width)) and _index(slots, torch.int64, (tokens,))
                and _index(metadata.seq_lens, torch.int32, (batch,))
                and _index(metadata.query_start_loc, torch.int32, (batch + 1,))):
            return None
        step = self._step
        step[_TOKENS], step[_SEQS], step[_TABLE_WIDTH] = tokens, batch, width
        step[_ROTARY_HALF], step[_CS_STRIDE] = half, cs_stride
        step[_DATA_DTYPES] = (native.BF16_DATA if self.dtype is torch.bfloat16 else 0) | self._kv_bf16
        residual = torch.empty_like(hidden)
        scratch = torch.empty(tokens * self.scratch_width, dtype=self.dtype)
        native._check(native._library().pagedserve_decoder_layers(
            hidden.data_ptr(), residual.data_ptr(), scratch.data_ptr(), _address(self._layers),
            _address(self._kv), _address(step), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), metadata.seq_lens.data_ptr(), metadata.query_start_loc.data_ptr(),
            lora, self.eps, self.scale, torch.get_num_threads()))
        return hidden, residual


def _takes(packed, dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether the kernel runs this packed [n, k] weight on dtype activations as the layer would."""
    lib = native._library()
    if isinstance(packed, PackedQuant):
        return (packed.kind in ("q4", "q8") and packed.panel == lib.pagedserve_quant_linear_panel()
                and packed.perm is None and (packed.n, packed.k) == (n, k))
    if not isinstance(packed, PackedWeight) or packed.out_features != n:
        return False
    t = packed.tensor
    if packed.kind == "native":  # [panels, k, panel] fp32, fp32 activations only
        return (dtype is torch.float32 and t.dtype is torch.float32 and t.dim() == 3 and t.is_contiguous()
                and t.shape[1] == k and t.shape[2] == lib.pagedserve_linear_panel() and t.shape[0] * t.shape[2] >= n)
    if packed.kind == "native_bf16":  # [panels, k / 2, panel, 2] bf16
        return (t.dtype is torch.bfloat16 and t.dim() == 4 and t.is_contiguous() and t.shape[1] == (k + 1) // 2
                and t.shape[2:] == (native_linear.linear_bf16_panel(), 2) and t.shape[0] * t.shape[2] >= n)
    return False


def _index(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t.dtype is dtype and t.is_cpu and t.is_contiguous() and t.shape == shape
