#!/usr/bin/env bash
# Set up llama.cpp (through `llama-cpp-python`, which builds it from source) in its own virtual
# environment, never in ours: the reference system for GGUF models on CPU.
#
#   bash bench/peers/setup_llamacpp.sh        # -> $PAGEDSERVE_PEERS_DIR/llamacpp (default ~/.cache/pagedserve-peers/llamacpp)
#
# Idempotent: a venv that imports llama_cpp at the pinned version and was built on a CPU with
# these same flags is left as it is.
# Builds llama.cpp with cmake and the system C++ compiler: about 21 minutes on 2 busy cores
# (measured), 180 MB on disk. GGML_NATIVE=ON compiles for this machine's CPU (AVX2 / AVX-512 as
# present), as a user building llama.cpp on their own machine gets; such a build can die with an
# illegal instruction on another CPU, so the venv records the CPU flags it was built for
# (`built-for-cpu`, checked here and by bench/peers/llamacpp_env.py) and is rebuilt on a new one.
# Serve with `python -m llama_cpp.server` (bench/peers/llamacpp_server.py starts it).
set -euo pipefail

LLAMACPP_VERSION="${LLAMACPP_VERSION:-0.3.36}"
PEERS_DIR="${PAGEDSERVE_PEERS_DIR:-$HOME/.cache/pagedserve-peers}"
VENV="$PEERS_DIR/llamacpp"
PYTHON="${PYTHON:-python3}"
# The CPU's instruction-set flags (those ggml compiles for), sorted, one line: the same string as
# llamacpp_env.cpu_flags().
CPU_FLAGS="$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 | tr ' ' '\n' \
    | grep -E '^(sse|ssse|avx|f16c|fma|bmi|amx)' | LC_ALL=C sort | paste -sd' ')"

if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/built-for-cpu" 2>/dev/null)" = "$CPU_FLAGS" ] \
    && "$VENV/bin/python" - "$LLAMACPP_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
assert version("llama-cpp-python") == sys.argv[1]
import llama_cpp, llama_cpp.server  # noqa: F401
PY
then
    echo "llama.cpp (llama-cpp-python $LLAMACPP_VERSION) already set up in $VENV"
    exit 0
fi

started=$(date +%s)
mkdir -p "$PEERS_DIR"
rm -f "$VENV/built-for-cpu"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# --force-reinstall --no-cache-dir: a wheel built for another CPU is never reused.
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/python" -m pip install --quiet --no-cache-dir --force-reinstall \
    "llama-cpp-python[server]==$LLAMACPP_VERSION"
"$VENV/bin/python" - <<'PY'
import llama_cpp
print("llama-cpp-python", llama_cpp.__version__, "|", llama_cpp.llama_print_system_info().decode().strip())
PY
echo "$CPU_FLAGS" > "$VENV/built-for-cpu"
echo "llama.cpp set up in $VENV in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1) on disk"
