"""The one place megashard touches private PyTorch APIs (supported: torch 2.11 - 2.14).

Every private name megashard needs is imported here, with a fallback or a clear error where it moved
between releases; the rest of the package imports these names from this module only.
"""
from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
