"""Multi-module jobs on a running world: each module's ParallelState, built by its own ranks only, and the bridge
that moves activations and gradients across a seam.

    multi = MultiModuleLayout.from_config(ModulesConfig.from_dict(yaml_doc), dist.get_world_size())
    module, state = init_module_state(multi)            # (None, None) on a rank of no module: nothing is created
    bridge = ModuleBridge(multi, "encoder", "llm", state)
    bridge.send_forward(y)                               # encoder, last stage
    x = bridge.recv_forward((batch, hidden), dtype)      # llm, first stage (every tp/cp rank gets it)
    bridge.send_backward(x.grad)                         # llm, first stage (the replica leaders send)
    dy = bridge.recv_backward(y.shape, y.dtype)          # encoder, last stage

The links are :func:`megashard.layout.modules.pair_modules`' (see its rule); the transfers are point-to-point
``isend``/``irecv`` between the two modules' leaders on the default group, and a broadcast over the leader's
``tp_cp`` group of its own module. No rank outside the two boundary stages takes part.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megashard.errors import StateError
from megashard.layout.modules import ModuleLayout, MultiModuleLayout
from megashard.state.core import ParallelState

__all__ = ["ModuleBridge", "init_module_state"]


def init_module_state(multi: MultiModuleLayout, *, device_type: Optional[str] = None
                      ) -> tuple[Optional[ModuleLayout], Optional[ParallelState]]:
    """This rank's module and its :class:`ParallelState` (collective over the module's ranks only: its members
    create its groups; a rank of no module creates nothing and gets ``(None, None)``)."""
    if not dist.is_initialized():
        raise StateError("init_module_state needs torch.distributed: call init_process_group first")
    if dist.get_world_size() != multi.world_size:
        raise StateError(f"the modules were resolved for {multi.world_size} ranks, but the default group has "
                         f"{dist.get_world_size()}")
    module = multi.module_of(dist.get_rank())
    if module is None:
        return None, None
    if module.config is None:
        raise StateError(f"module '{module.name}' has no ParallelConfig; resolve it with ModulesConfig.resolve")
    state = ParallelState(module.config, module.layout, device_type=device_type, rank_offset=module.rank_offset)
    return module, state


def _part(t: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    n = t.shape[0]
    if n % parts:
        raise StateError(f"a batch of {n} cannot be split into {parts} equal parts across the module seam")
    step = n // parts
    return t.narrow(0, part * step, step)


class ModuleBridge:
    """Activations forward and gradients backward across the seam ``src -> dst`` for this rank.

    Args:
        multi: the job's modules.
        src, dst: module names (a connection: src's last pipeline stage feeds dst's first).
        state: this rank's ParallelState (of src or dst; None on other ranks, where every method is a no-op).

    Tensors are batch-first (dim 0 is split/concatenated); on the receiving side the caller gives the full local
    shape (after concatenation), so nothing about shapes travels.
    """

    def __init__(self, multi: MultiModuleLayout, src: str, dst: str, state: Optional[ParallelState]):
        self.src, self.dst = multi.module(src), multi.module(dst)
        self.links = multi.links(src, dst)
        self.rank = dist.get_rank()
        self.state = state
        s_stage = self.src.layout.sizes.pp - 1
        self.on_src = self.rank in self.src and state is not None and state.rank_in("pp") == s_stage
        self.on_dst = self.rank in self.dst and state is not None and state.rank_in("pp") == 0

    def _leader(self) -> int:
        assert self.state is not None
        return self.state.ranks("tp_cp")[0]

    def _share(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast the leader's tensor over this rank's tp_cp group (a no-op when it has one rank)."""
        assert self.state is not None
        if self.state.size("tp_cp") > 1:
            dist.broadcast(t, src=self._leader(), group=self.state.group("tp_cp"))
        return t

    @staticmethod
    def _wait(works: Sequence) -> None:
        for w in works:
            w.wait()

    def send_forward(self, output: torch.Tensor) -> None:
        """On src's last stage: the replica leaders send their parts of ``output`` (batch-first) to dst."""
        if not self.on_src:
            return
        out = output.detach().contiguous()
        self._wait([dist.isend(_part(out, l.src_part, l.src_parts).contiguous(), l.dst)
                    for l in self.links if l.src == self.rank])

    def recv_forward(self, shape: Sequence[int], dtype: torch.dtype, device: Optional[torch.device] = None
                     ) -> Optional[torch.Tensor]:
        """On dst's first stage: the input of local ``shape`` (None on other ranks), a leaf that requires grad."""
        if not self.on_dst:
            return None
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        mine = [l for l in self.links if l.dst == self.rank]
        self._wait([dist.irecv(_part(buf, l.dst_part, l.dst_parts), l.src) for l in mine])
        return self._share(buf).requires_grad_(True)

    def send_backward(self, grad: torch.Tensor) -> None:
        """On dst's first stage: the replica leaders send the gradient of the input back, sliced as it came."""
        if not self.on_dst:
            return
        g = grad.detach().contiguous()
        self._wait([dist.isend(_part(g, l.dst_part, l.dst_parts).contiguous(), l.src)
                    for l in self.links if l.dst == self.rank])

    def recv_backward(self, shape: Sequence[int], dtype: torch.dtype, device: Optional[torch.device] = None
                      ) -> Optional[torch.Tensor]:
        """On src's last stage: the gradient of the output (local ``shape``; every tp/cp rank gets it)."""
        if not self.on_src:
            return None
        buf = torch.zeros(tuple(shape), dtype=dtype, device=device)
        mine = [l for l in self.links if l.src == self.rank]
        self._wait([dist.irecv(_part(buf, l.src_part, l.src_parts), l.dst) for l in mine])
        return self._share(buf)
