"""Kernel tests run Triton in its interpreter unless a GPU is present."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit decorator runs, i.e. before kernels.triton_* is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "pagedserve.kernels.triton_kernels" in sys.modules:  # imported earlier in this session: decorate again
        importlib.reload(sys.modules["pagedserve.kernels.triton_kernels"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    here = Path(__file__).parent
    for item in items:
        if "cuda" in item.keywords and here in item.path.parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def one_thread():
    # Small kernels gain nothing from a second thread, and collapse when another process holds a core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def restore_available(monkeypatch):
    """For tests that re-evaluate native.available() under an environment set with monkeypatch."""
    from pagedserve.kernels import (  # not at the top: the Triton setting above must come first
        native,
    )

    native.available.cache_clear()
    yield
    monkeypatch.undo()
    native.available.cache_clear()
    assert native.available()
