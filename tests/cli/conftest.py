"""A tiny checkpoint for the command-line tests (no Ray cluster of the session's: the commands
start their own)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.tiny_models import build_tiny_model
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama"))
