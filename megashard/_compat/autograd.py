"""Autograd and optimizer internals: the checkpoint guard (:mod:`megashard.state.recompute`) and Adam's
``_init_group`` (:mod:`megashard.train.optim`).
"""
from __future__ import annotations

import torch


# --- autograd checkpoint guard (used by megashard.state.recompute) --------------------------------------
# False while torch.autograd.grad() (rather than .backward()) runs a graph: recompute cannot work then.
def autograd_checkpoint_valid() -> bool:
    """`torch.autograd._is_checkpoint_valid()`, or True on a torch without it."""
    fn = getattr(torch.autograd, "_is_checkpoint_valid", None)
    return True if fn is None else bool(fn())


# --- torch.optim.Adam internals (used by megashard.train.optim) ------------------------------------------
def adam_init_group(opt, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps) -> bool:
    """``torch.optim.Adam._init_group``: fills the lists with a group's parameters that have gradients and their
    state (created on first use); returns whether any is complex. Same signature in torch 2.11 - 2.15."""
    return bool(opt._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps))
