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
#
# torch is pinned to 2.13.0 (megashard supports 2.11 - 2.14), preferring the CPU build:
#   1. a torch wheel pip finds on local disk (pip's find-links, e.g. PIP_FIND_LINKS=/opt/wheels), no download;
#   2. else the PyTorch CPU index (~200 MB), tried with a short timeout;
#   3. else PyPI, whose Linux x86_64 torch is the CUDA build (~4.7 GB with its nvidia-* packages).
# Then megashard itself (editable) with the `dev` (pytest), `plot` (matplotlib: loss.png), `data`
# (tokenizers: BPE tokenizers for `megashard data prepare`), `hf` (safetensors: `megashard ckpt export-hf`,
# `model.init_from`) and `hf-test` (transformers: the Hugging Face round-trip tests) extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=2.13.0
CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}

say() { echo "setup.sh: $*" >&2; }

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

# Everything present already (the venv's own view: without PYTHONPATH)?
ready() {
  env -u PYTHONPATH "$VPY" - "$PWD" <<'EOF' >/dev/null 2>&1
import os, sys
import torch, yaml, pytest, matplotlib, tokenizers, safetensors, transformers, megashard
assert (2, 11) <= tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15)
assert os.path.dirname(os.path.dirname(os.path.abspath(megashard.__file__))) == sys.argv[1]  # this checkout
EOF
}

if ! ready; then
  if ! env -u PYTHONPATH "$VPY" -c "import torch" >/dev/null 2>&1; then
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
  # torch's own dependencies (when it came without them) and megashard with its dev, plot, data, hf, hf-test extras.
  pip_ install -e ".[dev,plot,data,hf,hf-test]"
  ready || { say "error: $VENV is incomplete after installing; see the pip output above"; exit 1; }
fi
env -u PYTHONPATH "$VPY" - <<'EOF'
import sys
import matplotlib, megashard, torch
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
print(f"setup.sh: megashard {megashard.__version__} on torch {torch.__version__} ({build}), "
      f"Python {sys.version.split()[0]} ({sys.executable}), matplotlib {matplotlib.__version__}")
EOF
