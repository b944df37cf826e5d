"""The fused rotary + KV-cache store (csrc/rotary_kv.c) against its spec, pagedserve.kernels.rotary's
reference (apply_rotary, then store_kv), bit for bit: fp32 and bf16 activations, fp32 and bf16
caches, full and partial rotary dims, strided rows, every CPU level this CPU runs."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_features, native, native_norm_act, rotary
from pagedserve.kernels.backend import get_attention_backend

if not native.available():
    pytest.skip("no native CPU kernels here", allow_module_level=True)

_DETECTED = cpu_features.LEVELS.index(cpu_features.detected_level())
LEVELS = [None] + [lv for lv in ("avx2", "avx512", "avx512_bf16")
                   if _DETECTED >= cpu_features.LEVELS.index(lv)]
LEVEL_IDS = ["loaded" if lv is None else lv for lv in LEVELS]
BLOCKS, BLOCK_SIZE = 6, 4


def case(num_tokens, heads, kv_heads, head_dim, half, dtype, kv_dtype, pad=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width + pad, generator=gen).to(dtype)[:, :width]  # strided rows
    table = torch.randn(num_tokens, 1, 2 * half, generator=gen).to(dtype)
    cos, sin = table.chunk(2, dim=-1)  # views of one gathered table row per token, as RotaryEmbedding
    cache = torch.randn(2, BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(kv_dtype)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    return qkv, cos, sin, cache, slots


SHAPES = [(1, 9, 3, 64, 32), (3, 4, 2, 32, 16), (17, 2, 1, 64, 16), (5, 1, 1, 80, 40)]


@pytest.mark.parametrize("level", LEVELS, ids=LEVEL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}-h{}-kv{}-d{}-half{}".format(*s))
@pytest.mark.parametrize("pad", [0, 8])
def test_matches_the_reference_bit_for_bit(level, dtype, kv_dtype, shape, pad):
    num_tokens, heads, kv_heads, head_dim, half = shape
    qkv, cos, sin, cache, slots = case(num_tokens, heads, kv_heads, head_dim, half, dtype, kv_dtype, pad)
    want_cache = cache.clone()
    want_q = rotary.rotary_store_kv_reference(qkv.clone(), cos, sin, want_cache, slots, heads,
                                              kv_heads, head_dim)
    native_norm_act.rotary_store_kv(qkv, cos, sin, cache, slots, heads, kv_heads, head_dim, level=level)
    q = rotary.split_qkv(qkv, heads, kv_heads, head_dim)[0]
    assert torch.equal(q, want_q)
    assert torch.equal(cache, want_cache)


def test_two_threads_write_what_one_does():
    qkv, cos, sin, cache, slots = case(24, 4, 2, 32, 16, torch.float32, torch.float32, seed=3)
    one_qkv, one_cache = qkv.clone(), cache.clone()
    native_norm_act.rotary_store_kv(one_qkv, cos, sin, one_cache, slots, 4, 2, 32)
    torch.set_num_threads(2)
    native_norm_act.rotary_store_kv(qkv, cos, sin, cache, slots, 4, 2, 32)
    assert torch.equal(qkv, one_qkv) and torch.equal(cache, one_cache)


def test_a_slot_outside_the_cache_is_refused_before_anything_is_written():
    qkv, cos, sin, cache, slots = case(3, 4, 2, 32, 16, torch.float32, torch.float32)
    slots[1] = BLOCKS * BLOCK_SIZE
    before_qkv, before_cache = qkv.clone(), cache.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        native_norm_act.rotary_store_kv(qkv, cos, sin, cache, slots, 4, 2, 32)
    assert torch.equal(qkv, before_qkv) and torch.equal(cache, before_cache)


def test_operands_it_does_not_take_are_named():
    qkv, cos, sin, cache, slots = case(3, 4, 2, 32, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="rotary_store_kv takes"):
        native_norm_act.rotary_store_kv(qkv, cos, sin, cache, slots, 4, 2, 16)  # wrong head_dim
    with pytest.raises(ValueError, match="rotary_store_kv takes"):
        native_norm_act.rotary_store_kv(qkv, cos, sin, cache, slots.int(), 4, 2, 32)


@pytest.mark.parametrize("name", ["torch", "reference"])
def test_each_backend_rotates_and_stores_as_the_spec(name):
    backend = get_attention_backend(name)
    qkv, cos, sin, cache, slots = case(7, 4, 2, 32, 16, torch.bfloat16, torch.float32, seed=5)
    want_cache = cache.clone()
    want_q = rotary.rotary_store_kv_reference(qkv.clone(), cos, sin, want_cache, slots, 4, 2, 32)
    q = backend.rotary_store_kv(qkv, cos, sin, cache, slots, 4, 2, 32)
    assert torch.equal(q, want_q) and torch.equal(cache, want_cache)
