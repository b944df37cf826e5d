import pytest

from pagedserve.kernels import reference, torch_attention
from pagedserve.kernels.backend import get_attention_backend


def test_auto_on_cpu_is_the_torch_fast_path():
    backend = get_attention_backend("auto", "cpu")
    assert backend.name == "torch"
    assert backend.paged_attention is torch_attention.paged_attention
    assert backend.store_kv is torch_attention.store_kv


def test_reference_by_name():
    backend = get_attention_backend("reference")
    assert (backend.name, backend.paged_attention) == ("reference", reference.paged_attention)


def test_triton_by_name_imports():
    assert get_attention_backend("triton", "cpu").name == "triton"


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")
