"""The torch release megashard runs on, as ``(major, minor)``: what the compat modules branch on where a capability
cannot be probed.
"""
from __future__ import annotations

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]
