"""The grouped GEMM of a mixture of experts (csrc/gemm.c pagedserve_grouped_linear) equals
pagedserve.kernels.reference.grouped_linear at every CPU level this machine runs, for expert loads from
all-empty to one expert taking every row, on one and two threads."""
import pytest
import torch

from pagedserve.kernels import cpu_features, native_linear, reference

LEVELS = ["avx2", "avx512", "avx512_bf16"]

# rows per group: a decode step's few rows per expert, idle experts, a prefill's many rows
LOADS = [[1], [3, 0, 5, 1], [0, 0, 0, 0], [0, 13, 0, 0], [6, 7, 8, 9, 14, 15, 16, 17], [70, 1, 0, 33]]


def _runs_here(level):
    levels = cpu_features.LEVELS
    return native_linear.linear_available() and levels.index(cpu_features.detected_level()) >= levels.index(level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("load", LOADS, ids=lambda load: "-".join(map(str, load)))
@pytest.mark.parametrize("n,k", [(48, 16), (100, 37), (200, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_linear_matches_reference(level, load, n, k, threads):
    if not _runs_here(level):
        pytest.skip(f"no {level} GEMM on this CPU")
    torch.manual_seed(sum(load) + n + k)
    weights = torch.randn(len(load), n, k)
    offsets = torch.tensor([0, *load]).cumsum(0)
    x = torch.randn(int(offsets[-1]), k)
    packed = torch.stack([native_linear.pack_linear_weight(w, level) for w in weights])
    torch.set_num_threads(threads)  # the autouse one_thread fixture restores it
    out = native_linear.grouped_linear(x, packed, offsets, n)
    torch.testing.assert_close(out, reference.grouped_linear(x, weights, offsets), rtol=1e-5, atol=1e-4)


def test_grouped_linear_reads_strided_rows():
    if not native_linear.linear_available():
        pytest.skip("no native GEMM on this machine")
    weights, offsets = torch.randn(2, 48, 32), torch.tensor([0, 3, 5])
    x = torch.randn(5, 64)[:, 16:48]
    packed = torch.stack([native_linear.pack_linear_weight(w) for w in weights])
    torch.testing.assert_close(native_linear.grouped_linear(x, packed, offsets, 48),
                               reference.grouped_linear(x, weights, offsets), rtol=1e-5, atol=1e-4)


def test_grouped_linear_rejects_bad_offsets():
    if not native_linear.linear_available():
        pytest.skip("no native GEMM on this machine")
    packed = torch.stack([native_linear.pack_linear_weight(torch.randn(48, 16)) for _ in range(2)])
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="never decrease"):
        native_linear.grouped_linear(x, packed, torch.tensor([0, 5, 4]), 48)
    with pytest.raises(ValueError, match="offsets end at"):
        native_linear.grouped_linear(x, packed, torch.tensor([0, 1, 3]), 48)
    with pytest.raises(ValueError, match="do not fit"):
        native_linear.grouped_linear(x, packed, torch.tensor([0, 4]), 48)  # one offset short
    with pytest.raises(ValueError, match="do not fit"):
        native_linear.grouped_linear(torch.randn(4, 17), packed, torch.tensor([0, 2, 4]), 48)
