"""The spec itself, checked against dense SDPA on contiguous K/V (one sequence at a time)."""
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.kernel_cases import Case
from pagedserve.kernels import reference


def test_reference_matches_dense_attention():
    case = Case([(1, 1), (1, 33), (12, 12), (5, 40)], num_heads=6, num_kv_heads=2)
    cache = case.stored_cache(reference.store_kv)
    out = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(case.metadata.query_lens_cpu, case.metadata.seq_lens_cpu)):
        k, v = reference.gather_kv(cache, case.metadata.block_tables[b], s_len)
        q = case.query[start:start + q_len].transpose(0, 1)
        mask = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]
        expected = F.scaled_dot_product_attention(q, k.transpose(0, 1).repeat_interleave(3, 0),
                                                  v.transpose(0, 1).repeat_interleave(3, 0),
                                                  attn_mask=mask, scale=case.scale).transpose(0, 1)
        torch.testing.assert_close(out[start:start + q_len], expected, atol=1e-5, rtol=1e-5)
        start += q_len


def test_store_kv_writes_exactly_the_slots():
    case = Case([(3, 20), (1, 5)], num_kv_heads=2, block_size=4)
    cache = case.stored_cache(reference.store_kv)
    changed = (cache != case.kv_cache).flatten(3).any(-1)  # [2, num_blocks, block_size]
    slots = changed[0].flatten().nonzero().flatten()
    assert slots.tolist() == sorted(case.metadata.slot_mapping.tolist())
    assert torch.equal(changed[0], changed[1])


@pytest.mark.parametrize("window", [1, 5, 16, 40, 100])
@pytest.mark.parametrize("soft_cap", [None, 1.5])
def test_sliding_window_and_soft_cap_follow_transformers(window, soft_cap):
    """The window is transformers' own mask function; the cap is Gemma 2's tanh."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    case = Case([(1, 1), (1, 33), (12, 12), (5, 40), (40, 40)], num_heads=6, num_kv_heads=2,
                sliding_window=window)
    cache = case.stored_cache(reference.store_kv)
    out = reference.paged_attention(case.query, cache, case.metadata, case.scale,
                                    sliding_window=window, logits_soft_cap=soft_cap)
    allowed = sliding_window_causal_mask_function(window)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(case.metadata.query_lens_cpu, case.metadata.seq_lens_cpu)):
        first = reference.first_key_position(s_len, q_len, window)
        k, v = reference.gather_kv(cache, case.metadata.block_tables[b], s_len, first)
        q = case.query[start:start + q_len].transpose(0, 1)
        k = k.transpose(0, 1).repeat_interleave(3, 0)
        v = v.transpose(0, 1).repeat_interleave(3, 0)
        mask = torch.tensor([[bool(allowed(0, 0, torch.tensor(i), torch.tensor(j)))
                              for j in range(first, s_len)] for i in range(s_len - q_len, s_len)])
        scores = q @ k.transpose(1, 2) * case.scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
        torch.testing.assert_close(out[start:start + q_len], expected.transpose(0, 1), atol=1e-5, rtol=1e-5)
        assert torch.isfinite(out[start:start + q_len]).all()  # the dropped (NaN) blocks were not read
        start += q_len


def test_defaults_are_plain_causal_attention():
    case = Case([(1, 33), (12, 12), (5, 40)], num_heads=6, num_kv_heads=2)
    cache = case.stored_cache(reference.store_kv)
    plain = reference.paged_attention(case.query, cache, case.metadata, case.scale)
    # A window as long as the longest context changes nothing.
    wide = reference.paged_attention(case.query, cache, case.metadata, case.scale, sliding_window=40)
    assert torch.equal(plain, wide)
