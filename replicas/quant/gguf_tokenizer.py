"""The Hugging Face tokenizer (with its chat template) that a GGUF file's metadata describes,
converted once by transformers and cached as an ordinary tokenizer folder.

The cache key is the file's resolved path, size and modification time, so an edited or replaced
file converts again. Needs no weights and never imports torch into the caller: transformers'
GGUF conversion does, so a process that has not imported torch yet (the ingress) converts in a
child process.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedserve.replicas.model_files.default_model import cache_root

MARKER = ".pagedserve-gguf-tokenizer"


def cache_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]


def tokenizer_dir(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The cached tokenizer folder for a GGUF file, converting it on first use."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    target = cache_root(cache_dir) / "gguf-tokenizers" / f"{path.stem}-{cache_key(path)}"
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if "torch" not in sys.modules:
        _convert_in_child(path, cache_dir)
        if (target / MARKER).is_file():
            return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = convert(path)
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps({"source": str(path.resolve())}))
        try:
            os.rename(tmp, target)
        except OSError:  # another process published it first
            if not (target / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_in_child(path: Path, cache_dir: str | Path | None) -> None:
    code = ("import sys, torch; from pagedserve.replicas.quant.gguf_tokenizer import tokenizer_dir; "
            "tokenizer_dir(sys.argv[1], sys.argv[2] or None)")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(cache_dir or "")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise ValueError(lines[-1].removeprefix("ValueError: ") if lines else
                         f"{str(path)!r}: tokenizer conversion failed (exit {done.returncode})")


def convert(path: Path):
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as error:  # transformers raises many kinds for a metadata it cannot read
        raise ValueError(f"{str(path)!r}: cannot build a tokenizer from the GGUF metadata "
                         f"({type(error).__name__}: {error})") from error
    if tokenizer.eos_token is None:
        raise ValueError(f"{str(path)!r}: the GGUF tokenizer has no eos token")
    return tokenizer

