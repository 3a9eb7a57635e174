#!/usr/bin/env bash
# Prove megashard's GPU path on this machine, or show exactly what breaks: set up, run tests/gpu, a short default job
# on the GPU and the GPU benchmarks, print ONE summary table (every check passed, failed, or skipped with its
# reason) and write it as JSON. Meant for a machine with one NVIDIA GPU; on a machine without one every check is
# skipped with its reason and the exit status is 0.
#
#   bash tools/gpu-check.sh                           # fresh clone: .venv-gpu with torch 2.13.0 for this CUDA, then check
#   bash tools/gpu-check.sh --no-setup                # reuse .venv-gpu (or GPU_CHECK_VENV) as it is: no installs
#   GPU_CHECK_VENV=.venv bash tools/gpu-check.sh      # reuse an existing venv as it is (implies --no-setup)
#
# Set-up (skipped with --no-setup / GPU_CHECK_VENV):
#   1. nvidia-smi reports the driver's CUDA version; torch 2.13.0 comes from the newest PyTorch CUDA index the driver
#      runs (cu130 >= 13.0, cu128 >= 12.8, cu126 >= 12.6), else from PyPI's default build; without nvidia-smi the
#      CPU build (tools/setup.sh's choice). A venv holding a CPU torch on a GPU machine gets the CUDA build instead.
#   2. tools/setup.sh: megashard (editable) with its dev, plot and data extras.
#   3. transformer-engine[pytorch], attempted with a timeout (GPU_CHECK_TE_TIMEOUT s, default 1200): its failure is
#      reported (the TE tests are skipped with the install error), never fatal.
# Options: --out DIR (default runs/gpu-check; the summary is DIR/summary.json), --steps N (default job steps, 50).
# Exit status: 0 when no check failed, 1 when one did, 2 when the set-up itself failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=runs/gpu-check
STEPS=50
SETUP=1
[ -n "${GPU_CHECK_VENV:-}" ] && SETUP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-setup) SETUP=0 ;;
    --out) OUT=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check.sh: error: unknown argument '$1' (valid: --no-setup, --out DIR, --steps N, --help)" >&2; exit 2 ;;
  esac
  shift
done
VENV=${GPU_CHECK_VENV:-.venv-gpu}
TORCH=2.13.0
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STEPS_TSV=$OUT/steps.tsv
: > "$STEPS_TSV"
rm -f "$OUT/tests.xml" "$OUT/summary.json"
say() { echo "gpu-check.sh: $*" >&2; }
step() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$STEPS_TSV"; }
last_error() { { grep -E "ERROR|Error|error:" "$1" 2>/dev/null || tail -1 "$1" 2>/dev/null; } | tail -1 | cut -c1-300; }

# ------------------------------------------------------------------------------------------------ the machine
DRIVER_CUDA=""
GPU_NAME=""
if command -v nvidia-smi >/dev/null 2>&1; then
  DRIVER_CUDA=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -1)
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
fi
ver_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }  # $1 >= $2
cuda_index() {
  local v=$1
  if ver_ge "$v" 13.0; then echo cu130; elif ver_ge "$v" 12.8; then echo cu128; elif ver_ge "$v" 12.6; then echo cu126; fi
}

# ------------------------------------------------------------------------------------------------ set-up
TE_ERROR=""
if [ "$SETUP" = 1 ]; then
  PY=${PYTHON:-python3}
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $(command -v "$PY")"
    "$PY" -m venv "$VENV" || { say "error: '$PY -m venv $VENV' failed (on Debian/Ubuntu: apt-get install python3-venv)"; exit 2; }
  fi
  pip_() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
  has_cuda_torch() { env -u PYTHONPATH "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; }
  if [ -n "$DRIVER_CUDA" ] && has_cuda_torch; then
    step "setup: torch" passed "already in $VENV: $(env -u PYTHONPATH "$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  elif [ -n "$DRIVER_CUDA" ]; then
    INDEX=$(cuda_index "$DRIVER_CUDA")
    if [ -n "$INDEX" ] && pip_ install --force-reinstall --timeout 60 "torch==$TORCH" \
        --index-url "https://download.pytorch.org/whl/$INDEX" 2>"$OUT/torch-install.log"; then
      step "setup: torch" passed "torch $TORCH for $INDEX (driver CUDA $DRIVER_CUDA)"
    else
      why=${INDEX:+$(last_error "$OUT/torch-install.log")}
      say "no torch $TORCH from the PyTorch ${INDEX:-<no index for driver CUDA $DRIVER_CUDA>} index${why:+ ($why)}; trying PyPI's default build"
      if pip_ install --force-reinstall "torch==$TORCH" 2>>"$OUT/torch-install.log"; then
        step "setup: torch" passed "torch $TORCH from PyPI (no ${INDEX:-matching} PyTorch index for driver CUDA $DRIVER_CUDA)"
      else
        step "setup: torch" failed "torch $TORCH did not install: $(last_error "$OUT/torch-install.log")"
      fi
    fi
  fi
  if ! VENV="$VENV" bash tools/setup.sh >"$OUT/setup.log" 2>&1; then
    cat "$OUT/setup.log" >&2
    say "error: tools/setup.sh failed (log: $OUT/setup.log)"; exit 2
  fi
  step "setup: megashard" passed "$(tail -1 "$OUT/setup.log" | sed 's/^setup.sh: //')"
  if [ -z "$DRIVER_CUDA" ]; then
    TE_ERROR="not attempted: no NVIDIA driver (nvidia-smi not found)"
    step "setup: transformer-engine" skipped "$TE_ERROR"
  elif env -u PYTHONPATH "$VENV/bin/python" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
    step "setup: transformer-engine" passed "already installed"
  elif timeout "${GPU_CHECK_TE_TIMEOUT:-1200}" "$VENV/bin/python" -m pip -q --disable-pip-version-check install \
      --no-build-isolation "transformer-engine[pytorch]" >"$OUT/te-install.log" 2>&1; then
    step "setup: transformer-engine" passed "installed"
  else
    rc=$?
    TE_ERROR=$([ "$rc" = 124 ] && echo "timed out after ${GPU_CHECK_TE_TIMEOUT:-1200} s" || last_error "$OUT/te-install.log")
    step "setup: transformer-engine" skipped "pip install transformer-engine[pytorch] failed: $TE_ERROR (log: $OUT/te-install.log)"
  fi
else
  [ -x "$VENV/bin/python" ] || { say "error: no venv at $VENV (GPU_CHECK_VENV / --no-setup reuse one; drop them to set one up)"; exit 2; }
  step "setup" skipped "reusing $VENV as it is (--no-setup or GPU_CHECK_VENV): nothing installed"
fi
VPY=$VENV/bin/python
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's megashard, whatever the venv holds
export MEGASHARD_TE_INSTALL_ERROR="$TE_ERROR"

# One interpreter start: the torch build, the Python version, and why CUDA cannot be used here (empty: it can).
FACTS=$("$VPY" -c 'import sys, torch
from megashard.state.devices import cuda_unavailable_reason as r
print(torch.__version__, "CUDA", torch.version.cuda); print(sys.version.split()[0]); print(r() or "")' 2>&1) || {
  say "error: $VPY cannot import megashard and torch: $FACTS"; exit 2; }
TORCH_LINE=$(sed -n 1p <<<"$FACTS")
PY_VERSION=$(sed -n 2p <<<"$FACTS")
NO_CUDA=$(sed -n 3p <<<"$FACTS")
if [ -n "$DRIVER_CUDA" ] && [ -n "$NO_CUDA" ]; then  # a GPU machine whose torch cannot use the GPU: say so, loudly
  if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ]; then
    step "setup: cuda" skipped "${GPU_NAME:-a GPU} is hidden on purpose (CUDA_VISIBLE_DEVICES='')"
  else
    step "setup: cuda" failed "nvidia-smi shows ${GPU_NAME:-a GPU} (driver CUDA $DRIVER_CUDA), but torch $TORCH_LINE cannot use it: $NO_CUDA"
  fi
fi

# ------------------------------------------------------------------------------------------------ the checks
say "tests/gpu (log: $OUT/pytest.log)"
"$VPY" -m pytest tests/gpu -q -rs --strict-markers -p no:cacheprovider --junitxml="$OUT/tests.xml" \
  >"$OUT/pytest.log" 2>&1
tail -3 "$OUT/pytest.log" >&2

if [ -n "$NO_CUDA" ]; then
  step "default job on cuda ($STEPS steps)" skipped "needs CUDA: $NO_CUDA"
  step "benchmarks/gpu.py" skipped "needs CUDA: $NO_CUDA"
else
  say "the default job on the GPU, $STEPS steps (log: $OUT/job.log)"
  start=$SECONDS
  rm -rf "$OUT/job"  # a fresh run each time (its checkpoints would otherwise clash with the last run's)
  if "$VPY" -m megashard run configs/default.yaml parallel.device=cuda parallel.tp=1 parallel.dp_shard=1 \
      launch.nproc_per_node=1 launch.max_restarts=0 "train.steps=$STEPS" train.out_dir="$OUT/job" train.resume=false \
      train.progress=false checkpoint.interval=25 >"$OUT/job.log" 2>&1; then
    step "default job on cuda ($STEPS steps)" passed "$(grep -m1 'megashard run: default' "$OUT/job.log" | sed 's/^megashard run: //'); $((SECONDS - start)) s"
  else
    step "default job on cuda ($STEPS steps)" failed "$(last_error "$OUT/job.log") (log: $OUT/job.log)"
  fi
  say "benchmarks/gpu.py (log: $OUT/bench.log)"
  if "$VPY" benchmarks/gpu.py >"$OUT/bench.log" 2>&1; then
    step "benchmarks/gpu.py" passed "table in $OUT/bench.log, JSON in benchmarks/results/gpu.json"
    sed -n '/^GPU benchmarks/,/^wrote/p' "$OUT/bench.log" >&2
  else
    step "benchmarks/gpu.py" failed "$(last_error "$OUT/bench.log") (log: $OUT/bench.log)"
  fi
fi

"$VPY" tools/gpu_check_report.py --junit "$OUT/tests.xml" --steps "$STEPS_TSV" --json "$OUT/summary.json" \
  $([ -z "$NO_CUDA" ] && echo --bench benchmarks/results/gpu.json) \
  --machine "gpu=${GPU_NAME:-none}" --machine "driver_cuda=${DRIVER_CUDA:-none}" --machine "torch=$TORCH_LINE" \
  --machine "python=$PY_VERSION" --machine "venv=$VENV"
