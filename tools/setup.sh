#!/usr/bin/env bash
# Set up everything megashard and its examples need in a virtual environment (idempotent: a second run
# only checks and prints what is there).
#
#   bash tools/setup.sh                                  # ./.venv from `python3`
#   PYTHON=/usr/bin/python3.11 VENV=.venv-sys bash tools/setup.sh
#
# PYTHON: the interpreter (3.10+) the venv is made from (default: python3 on PATH).
# VENV:   the venv directory (default: .venv in the repository root).
# TORCH_CPU_INDEX: the PyTorch CPU wheel index (default https://download.pytorch.org/whl/cpu; "" = skip it).
# TORCH_CUDA: a CUDA build of torch instead, for GPUs (replaces a CPU torch already in the venv):
#   auto          the newest PyTorch CUDA index the NVIDIA driver runs (nvidia-smi: cu130 >= 13.0, cu128 >= 12.8,
#                 cu126 >= 12.6), as tools/gpu-check.sh chooses;
#   cu130|cu128|cu126  that PyTorch index (https://download.pytorch.org/whl/<tag>);
#   pypi          PyPI's torch, which on Linux x86_64 is a CUDA build (~4.7 GB with its nvidia-* packages).
#
# torch is pinned to 2.13.0 (megashard supports 2.11 - 2.15), preferring the CPU build:
#   1. a torch wheel pip finds on local disk (pip's find-links, e.g. PIP_FIND_LINKS=/opt/wheels), no download;
#   2. else the PyTorch CPU index (~200 MB), tried with a short timeout;
#   3. else PyPI, whose Linux x86_64 torch is the CUDA build (~4.7 GB with its nvidia-* packages).
# Then megashard itself (editable) with the `dev` (pytest), `plot` (matplotlib: loss.png), `data`
# (tokenizers: BPE tokenizers for `megashard data prepare`), `hf` (safetensors: `megashard ckpt export-hf`,
# `model.init_from`), `hf-test` (transformers: the Hugging Face round-trip tests), `tensorboard` and `wandb`
# (train.tensorboard, train.wandb: the logger tests) extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=2.13.0
CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}

say() { echo "setup.sh: $*" >&2; }

# A CUDA build asked for (TORCH_CUDA): its index, checked before anything is created.
CUDA_TAG=${TORCH_CUDA:-}
CUDA_URL=""
if [ "$CUDA_TAG" = auto ]; then
  driver=$( { nvidia-smi 2>/dev/null || true; } | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -1)
  if [ -z "$driver" ]; then
    say "error: TORCH_CUDA=auto reads the driver's CUDA version from nvidia-smi, which is missing or shows none here;"
    say "       name the build (TORCH_CUDA=cu130, cu128, cu126 or pypi), or leave TORCH_CUDA unset for the CPU build"; exit 2
  fi
  ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }  # $1 >= $2
  if ge "$driver" 13.0; then CUDA_TAG=cu130; elif ge "$driver" 12.8; then CUDA_TAG=cu128
  elif ge "$driver" 12.6; then CUDA_TAG=cu126
  else say "error: the NVIDIA driver supports CUDA $driver; torch $TORCH needs 12.6 or newer (update the driver)"; exit 2; fi
  say "TORCH_CUDA=auto: driver CUDA $driver -> $CUDA_TAG"
fi
case "$CUDA_TAG" in
  "") ;;
  cu130|cu128|cu126) CUDA_URL="https://download.pytorch.org/whl/$CUDA_TAG" ;;
  pypi) ;;
  *) say "error: TORCH_CUDA='$CUDA_TAG' is not a build this script knows; use auto, cu130, cu128, cu126 or pypi"; exit 2 ;;
esac

if ! command -v "$PY" >/dev/null 2>&1; then
  say "error: no Python interpreter '$PY' (set PYTHON=/path/to/python3.10+)"; exit 2
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  say "error: $("$PY" -V 2>&1) at $(command -v "$PY") is too old: megashard needs Python 3.10+ (set PYTHON=...)"; exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $(command -v "$PY") ($("$PY" -V 2>&1))"
  if ! "$PY" -m venv "$VENV"; then
    say "error: '$PY -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"; rm -rf "$VENV"; exit 2
  fi
fi
VPY="$VENV/bin/python"
pip_() { "$VPY" -m pip -q --disable-pip-version-check "$@"; }

# Everything present already (the venv's own view: without PYTHONPATH)? With TORCH_CUDA: a CUDA build of torch.
ready() {
  env -u PYTHONPATH "$VPY" - "$PWD" "$CUDA_TAG" <<'EOF' >/dev/null 2>&1
import os, sys
import torch, yaml, pytest, matplotlib, tokenizers, safetensors, transformers, tensorboard, wandb, megashard
assert (2, 11) <= tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 16)
assert torch.version.cuda or not sys.argv[2]
assert os.path.dirname(os.path.dirname(os.path.abspath(megashard.__file__))) == sys.argv[1]  # this checkout
EOF
}

if ! ready; then
  if [ -n "$CUDA_TAG" ] && ! env -u PYTHONPATH "$VPY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' \
      >/dev/null 2>&1; then
    env -u PYTHONPATH "$VPY" -c "import torch" >/dev/null 2>&1 && pip_ uninstall -y torch  # the CPU build goes
    say "torch $TORCH: the CUDA build from ${CUDA_URL:-PyPI} (a few GB with its nvidia-* packages)"
    pip_ install "torch==$TORCH" ${CUDA_URL:+--index-url "$CUDA_URL"}
  elif ! env -u PYTHONPATH "$VPY" -c "import torch" >/dev/null 2>&1; then
    if pip_ install --no-index --no-deps "torch==$TORCH" 2>/dev/null; then
      say "torch $TORCH: the wheel found on local disk (pip find-links)"
    elif [ -n "$CPU_INDEX" ] && pip_ install --no-deps --timeout 15 --retries 0 --index-url "$CPU_INDEX" \
        "torch==$TORCH" 2>"$VENV/cpu-index.log"; then
      say "torch $TORCH: the CPU build from $CPU_INDEX"
    else
      why=$( { grep -E "ERROR|Error" "$VENV/cpu-index.log" 2>/dev/null || true; } | tail -1)
      say "note: no local torch wheel, and no CPU build from ${CPU_INDEX:-(TORCH_CPU_INDEX empty)}${why:+ ($why)}:"
      say "      installing torch $TORCH from PyPI, which on Linux x86_64 is the CUDA build (~4.7 GB with its"
      say "      nvidia-* packages; it runs on CPU too)"
      pip_ install "torch==$TORCH"
    fi
    rm -f "$VENV/cpu-index.log"
  fi
  # torch's own dependencies (when it came without them) and megashard with its dev, plot, data, hf, hf-test,
  # tensorboard and wandb extras.
  pip_ install -e ".[dev,plot,data,hf,hf-test,tensorboard,wandb]"
  ready || { say "error: $VENV is incomplete after installing; see the pip output above"; exit 1; }
fi
env -u PYTHONPATH "$VPY" - <<'EOF'
import sys
import matplotlib, megashard, torch
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"setup.sh: megashard {megashard.__version__} on torch {torch.__version__} ({build}), "
      f"Python {sys.version.split()[0]} ({sys.executable}), matplotlib {matplotlib.__version__}")
EOF
