"""Where the llama.cpp virtual environment is, the environment it runs with, and how its OpenAI
server (`python -m llama_cpp.server`, llama-cpp-python 0.3.36, through bench/peers/llamacpp_server.py)
is started fairly.

Only the standard library: this is imported from our venv to start processes in llama.cpp's.
llama.cpp is compiled for the CPU it was built on (GGML_NATIVE): `llamacpp_python()` refuses a
venv built on a CPU with other flags (machines here vary; an AVX-512 build dies on an AVX2 one).

What that server can and cannot do (read from its source, 0.3.36):
- No continuous batching and no `n_parallel`: one `Llama` per model, behind a lock, so requests
  run one at a time and the rest wait in line. There is nothing to configure for concurrency.
- `interrupt_requests` (default on) ends a stream as soon as another request is waiting, so under
  concurrency every stream but the last would stop after one token. Turned off here: requests queue.
- `logits_all` (default on in the server, off in `Llama`) computes the LM head over every prompt
  token, for prompt logprobs nobody asks for here. Turned off.
- `n_threads` defaults to half the CPUs and `n_threads_batch` (prefill) to all of them: both are
  set to the same N threads the other systems get.
- It has no `ignore_eos` (unknown fields are dropped silently; its `min_tokens` holds back only the
  one eos id, not <|im_end|> and the other end-of-generation tokens) and its `repeat_penalty`
  defaults to 1.1: `SERVER_REQUEST_EXTRAS` turns the penalty off, and the end-of-generation tokens
  get a large negative `logit_bias` (see `eog_logit_bias`), so every request generates its full
  length. Chat requests need `max_tokens`: `max_completion_tokens` is ignored (no limit then).
- Settings are pydantic-settings: any environment variable named like one (API_KEY, MODEL, PORT,
  CACHE, VERBOSE...) changes it. The server gets a minimal environment (`llamacpp_environ`).
- It answers 400 (empty body) to an `x-request-id` that is not a UUID, which `vllm bench serve`
  always sends: llamacpp_server.py starts the same server without that check.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from bench.peers.vllm_env import PEERS_DIR
from pagedserve.kernels import cpu_features

SETUP_SCRIPT = Path(__file__).resolve().parent / "setup_llamacpp.sh"
OFFLINE_SCRIPT = Path(__file__).resolve().parent / "llamacpp_offline.py"
SERVER_SCRIPT = Path(__file__).resolve().parent / "llamacpp_server.py"
# What the server's environment keeps of ours (besides the thread settings).
KEPT_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR")
# Per request, on top of what the load generator sends: no repeat penalty (the server's default
# is 1.1; the other systems default to none).
SERVER_REQUEST_EXTRAS = {"repeat_penalty": 1.0}
# Added to an end-of-generation token's logit: it is never the greedy (or any sampled) choice.
EOG_BIAS = -1000.0
# The CPU flags a native llama.cpp build depends on (the pattern setup_llamacpp.sh greps for).
ISA_FLAGS = re.compile(r"^(sse|ssse|avx|f16c|fma|bmi|amx)")


def cpu_flags() -> str:
    """This CPU's instruction-set flags as setup_llamacpp.sh stamps them into the venv
    (`built-for-cpu`): the SIMD ones ggml compiles for, so unrelated flags never force a rebuild."""
    return " ".join(sorted(f for f in cpu_features.cpu_flags() if ISA_FLAGS.match(f)))


def llamacpp_python() -> Path:
    """The llama.cpp venv's interpreter; raises with the set-up command when it is missing or was
    built for another CPU."""
    venv = PEERS_DIR / "llamacpp"
    python, stamp = venv / "bin" / "python", venv / "built-for-cpu"
    if not python.exists():
        raise FileNotFoundError(f"no llama.cpp environment at {venv}: run `bash {SETUP_SCRIPT}`")
    if stamp.exists() and stamp.read_text().strip() != cpu_flags():
        raise RuntimeError(f"the llama.cpp in {venv} was compiled for a CPU with other flags than "
                           f"this one: run `bash {SETUP_SCRIPT}` to rebuild it here")
    return python


def llamacpp_environ(threads: int) -> dict[str, str]:
    """A minimal environment for llama.cpp on `threads` threads: ours only for KEPT_ENV, so no
    variable of ours turns into a server setting. No core binding (pagedserve has none either)."""
    env = {key: os.environ[key] for key in KEPT_ENV if key in os.environ}
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    return env


def server_command(model: str | Path, threads: int, port: int, n_ctx: int, alias: str) -> list[str]:
    """`python -m llama_cpp.server` on one GGUF file, `threads` threads for decode and prefill,
    on 127.0.0.1:port; see the module docstring for the settings it changes and why."""
    return [str(llamacpp_python()), str(SERVER_SCRIPT), "--model", str(model),
            "--model_alias", alias, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
            "--interrupt_requests", "false", "--logits_all", "false", "--verbose", "false"]


def run_in_llamacpp(script: str | Path, *script_args: str, threads: int,
                    **run_kwargs) -> subprocess.CompletedProcess:
    """Run a script with the llama.cpp venv's interpreter on `threads` threads; raises on failure."""
    return subprocess.run([str(llamacpp_python()), str(script), *script_args],
                          env=llamacpp_environ(threads), check=True, **run_kwargs)


def eog_token_ids(model: str | Path) -> list[int]:
    """The tokens llama.cpp ends generation at for this GGUF file (its own list, not ours)."""
    out = run_in_llamacpp(OFFLINE_SCRIPT, "--model", str(model), "--eog", threads=1,
                          capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def eog_logit_bias(model: str | Path) -> dict[str, float]:
    """A request's `logit_bias` that keeps llama.cpp from ending early: its `ignore_eos`."""
    return {str(token): EOG_BIAS for token in eog_token_ids(model)}
