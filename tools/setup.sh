#!/usr/bin/env bash
# Set up everything megashard needs in ./.venv (idempotent: a second run only checks).
# torch is pinned to 2.13.0, the CPU build CI uses (pip finds it on local disk where provided);
# megashard itself supports torch 2.11 - 2.14.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, yaml, pytest, megashard" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
fi
.venv/bin/python -c "import torch, megashard; print(f'megashard {megashard.__version__} on torch {torch.__version__}')"
