"""The spec itself, checked against dense SDPA on contiguous K/V (one sequence at a time)."""
import torch
import torch.nn.functional as F

from tests.kernels.kernel_cases import Case
from kernels import reference


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
