"""Collectives with values: rehearsed ranks that compute what the real job computes.

    recorder = Recorder(rank, world_size, channel, exact=True)   # every collective answered with its peers' values

The ``fake`` backend moves no data: an all-reduce leaves this rank's own value, an all-gather's other slots stay as
allocated, an all-to-all brings no peer's rows. Nothing in a step branches on those values — except a mixture of
experts: the tokens a rank's experts receive over ``ep``, and so what its expert layers hold, follow the router's
choices on every peer's tokens, which follow every value before them (the parameters FSDP gathers, the gradients
averaged at step 1, the global gradient norm). So an *exact* rehearsal runs every rank of the world together and
answers each collective as the backend would (:class:`Exchange`): each member posts to each other member the part
that member receives (the whole tensor for an all-reduce or all-gather, one chunk for a reduce-scatter or an
all-to-all) through the rehearsal's mailbox (:mod:`megashard.rehearse.broker`), takes the parts sent to it, and
writes the result into the call's output — sums in member order, in the tensor's dtype. The rank's ops, allocations
and order stay those of the fake rehearsal: the transfer copies are made with no dispatch mode watching
(:func:`megashard._compat.no_dispatch_modes`), as gloo's buffers are not tensors; only values change. The losses
then equal the real run's (tests/test_rehearse_exact.py) and a traced MoE peak equals the measured one.

It costs every rank's step in this machine's CPU and memory, so :mod:`megashard.advisor.trace` uses it only where
values decide memory (experts over ep > 1 ranks) and the world is small (:data:`EXACT_MAX_RANKS`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["EXACT_MAX_RANKS", "Exchange", "portable"]

#: The largest world an exact rehearsal runs (every rank at once, each with its real tensors).
EXACT_MAX_RANKS = 8


def _op_name(op: Any) -> str:
    """``sum``, ``avg``, ``max``, ``min``, ``product`` of a c10d ``ReduceOp`` or a functional collective's string."""
    if isinstance(op, str):
        return op.lower()
    name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
    return str(name).lower()


def _reduce(parts: list[torch.Tensor], op: Any, like: torch.Tensor) -> torch.Tensor:
    """The members' ``parts`` (in member order) reduced as ``op``, in ``like``'s dtype."""
    name = _op_name(op)
    acc = parts[0].to(like.dtype).clone()
    for p in parts[1:]:
        p = p.to(like.dtype)
        if name in ("sum", "avg"):
            acc.add_(p)
        elif name == "max":
            torch.maximum(acc, p, out=acc)
        elif name == "min":
            torch.minimum(acc, p, out=acc)
        elif name in ("product", "prod"):
            acc.mul_(p)
        else:  # premul_sum (NCCL's), bitwise ops: the trace fails, naming it, and the modelled figure decides
            raise ValueError(f"exact rehearsal: reduce op {name!r} is not supported (sum, avg, max, min, product are)")
    if name == "avg":
        acc = acc / len(parts) if not acc.is_floating_point() else acc.div_(len(parts))
    return acc


def _raw(t: Any) -> Any:
    """The plain tensor behind a functional collective's output (an ``AsyncCollectiveTensor``'s ``elem``)."""
    return getattr(t, "elem", t)


def _write(dst: Any, value: torch.Tensor) -> None:
    """``dst``'s storage gets ``value`` (its own version counter untouched: the tensor may be an autograd output)."""
    d = _raw(dst)
    d.data.copy_(value.reshape(d.shape).to(d.dtype))


def _chunks(t: torch.Tensor, n: int, dim: int = 0) -> list[torch.Tensor]:
    return list(t.chunk(n, dim)) if t.shape[dim] % n == 0 else list(t.tensor_split(n, dim))


def _rows(t: torch.Tensor, splits: Optional[list[int]], n: int) -> list[torch.Tensor]:
    """``t`` split along dim 0 as ``splits`` (None: evenly in ``n``)."""
    if splits is None:
        return list(t.chunk(n, 0)) if t.shape[0] else [t] * n
    return list(t.split([int(s) for s in splits], 0))


class Exchange:
    """The exact collectives of one rehearsed rank (see the module docstring). ``recorder``: its
    :class:`~megashard.rehearse.recorder.Recorder` (rank, channel, groups)."""

    def __init__(self, recorder: Any):
        self.recorder = recorder
        self.unanswered: set[str] = set()
        """Collectives this rank called that carry no values here (their outputs stay the fake backend's)."""

    # ------------------------------------------------------------------ the mailbox
    def _post(self, info: Any, seq: int, j: int, value: Any) -> None:
        rec = self.recorder
        rec.channel.put((rec.rank, info.ranks[j], info.key, seq, "x"), portable(value))

    def _take(self, info: Any, seq: int, j: int) -> Any:
        rec = self.recorder
        return rec.channel.get((info.ranks[j], rec.rank, info.key, seq, "x"))

    def _me(self, info: Any) -> int:
        return info.ranks.index(self.recorder.rank)

    def exchange(self, info: Any, seq: int, parts: list) -> list:
        """Every member sends ``parts[j]`` to member ``j`` of group ``info`` (its collective number ``seq``); returns
        what each member sent this rank, in member order (this rank's own part as given)."""
        me = self._me(info)
        for j, value in enumerate(parts):
            if j != me:
                self._post(info, seq, j, value)
        return [parts[j] if j == me else self._take(info, seq, j) for j in range(len(info.ranks))]

    def gather(self, info: Any, seq: int, value: Any) -> list:
        """Every member's ``value`` in member order (this rank's own as given)."""
        return self.exchange(info, seq, [value] * len(info.ranks))

    def fan_out(self, info: Any, seq: int, root: int, parts: Optional[list]) -> Any:
        """Member ``root`` sends ``parts[j]`` to each member ``j``; returns this rank's part."""
        me = self._me(info)
        if me != root:
            return self._take(info, seq, root)
        for j, value in enumerate(parts):
            if j != me:
                self._post(info, seq, j, value)
        return parts[me]

    def fan_in(self, info: Any, seq: int, root: int, value: Any) -> Optional[list]:
        """Every member sends ``value`` to member ``root``; returns every member's there (None elsewhere)."""
        me = self._me(info)
        if me != root:
            self._post(info, seq, root, value)
            return None
        return [value if j == me else self._take(info, seq, j) for j in range(len(info.ranks))]

    # ------------------------------------------------------------------ the collectives
    def settle(self, name: str, spec: Any, args: tuple, kwargs: dict, info: Any, seq: int, out: Any) -> Any:
        """Give the call's outputs the values the real backend would (``out``: what the fake call returned; a
        functional collective's new output is written in place). Returns ``out``."""
        from megashard._compat import no_dispatch_modes

        if len(info.ranks) <= 1 or self.recorder.rank not in info.ranks:
            return out
        with no_dispatch_modes(), torch.no_grad():
            handler = getattr(self, ("f_" if spec.functional else "c_") + name, None)
            if handler is not None:
                handler(_Args(args, kwargs), info, seq, out)
            elif name not in ("barrier", "monitored_barrier"):
                self.unanswered.add(name)
        return out

    # c10d (outputs given by the caller) ------------------------------------------------------------
    def c_all_reduce(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t = a.get("tensor", 0)
        t.copy_(_reduce(self.gather(info, seq, t), a.get("op", 1, "sum"), t))

    def c_all_reduce_coalesced(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        ts = a.get("tensors", 0)
        every = self.gather(info, seq, list(ts))
        for i, t in enumerate(ts):
            t.copy_(_reduce([e[i] for e in every], a.get("op", 1, "sum"), t))

    def c_broadcast(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t = a.get("tensor", 0)
        root = a.member(info, "src", 1, "group_src")
        t.copy_(self.fan_out(info, seq, root, [t] * len(info.ranks)))

    def c_all_gather(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        outs, t = a.get("tensor_list", 0), a.get("tensor", 1)
        for o, v in zip(outs, self.gather(info, seq, t)):
            o.copy_(v)

    def c_all_gather_into_tensor(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        o, t = a.get("output_tensor", 0), a.get("input_tensor", 1)
        o.view(len(info.ranks), -1).copy_(torch.stack([v.reshape(-1) for v in self.gather(info, seq, t)]))

    c_all_gather_single = c_all_gather_into_tensor

    def c_reduce_scatter_tensor(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        o, t = a.get("output", 0), a.get("input", 1)
        got = self.exchange(info, seq, list(t.reshape(len(info.ranks), -1)))
        o.copy_(_reduce(got, a.get("op", 2, "sum"), o).reshape(o.shape))

    c_reduce_scatter_single = c_reduce_scatter_tensor

    def c_reduce_scatter(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        o, ts = a.get("output", 0), a.get("input_list", 1)
        o.copy_(_reduce(self.exchange(info, seq, list(ts)), a.get("op", 2, "sum"), o))

    def c_reduce(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t = a.get("tensor", 0)
        every = self.fan_in(info, seq, a.member(info, "dst", 1, "group_dst"), t)
        if every is not None:
            t.copy_(_reduce(every, a.get("op", 2, "sum"), t))

    def c_all_to_all_single(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        o, t = a.get("output", 0), a.get("input", 1)
        n = len(info.ranks)
        got = self.exchange(info, seq, _rows(t, a.get("input_split_sizes", 3), n))
        for dst, v in zip(_rows(o, a.get("output_split_sizes", 2), n), got):
            dst.copy_(v.reshape(dst.shape))

    def c_gather(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t, outs = a.get("tensor", 0), a.get("gather_list", 1)
        every = self.fan_in(info, seq, a.member(info, "dst", 2, "group_dst"), t)
        for o, v in zip(outs or [], every or []):
            o.copy_(v)

    def c_scatter(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t, ins = a.get("tensor", 0), a.get("scatter_list", 1)
        t.copy_(self.fan_out(info, seq, a.member(info, "src", 2, "group_src"), ins))

    def c_all_to_all(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        outs, ins = a.get("output_tensor_list", 0), a.get("input_tensor_list", 1)
        for o, v in zip(outs, self.exchange(info, seq, list(ins))):
            o.copy_(v)

    # functional collectives (DTensor's; outputs are new tensors, written in place) -------------------
    def f_all_reduce(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t = a.get("self", 0)
        _write(out, _reduce(self.gather(info, seq, t), a.get("reduceOp", 1, "sum"), t))

    def f_all_gather_tensor(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t = a.get("self", 0)
        _write(out, torch.cat(self.gather(info, seq, t), dim=int(a.get("gather_dim", 1, 0))))

    f_all_gather_tensor_autograd = f_all_gather_tensor

    def f_reduce_scatter_tensor(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t = a.get("self", 0)
        got = self.exchange(info, seq, _chunks(t, len(info.ranks), int(a.get("scatter_dim", 2, 0))))
        _write(out, _reduce(got, a.get("reduceOp", 1, "sum"), t))

    f_reduce_scatter_tensor_autograd = f_reduce_scatter_tensor

    def f_all_to_all_single(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t = a.get("self", 0)
        _write(out, torch.cat(self.exchange(info, seq, _rows(t, a.get("input_split_sizes", 2), len(info.ranks))), 0))

    f_all_to_all_single_autograd = f_all_to_all_single

    def f_broadcast(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        t, src = a.get("self", 0), int(a.get("src", 1, 0))
        root = info.ranks.index(src) if src in info.ranks else src  # a global rank of the group, else its index
        _write(out, self.fan_out(info, seq, root, [t] * len(info.ranks)))

    def f_all_reduce_coalesced(self, a: "_Args", info: Any, seq: int, out: Any) -> None:
        ts = a.get("self", 0)
        every = self.gather(info, seq, list(ts))
        for i, (t, o) in enumerate(zip(ts, out)):
            _write(o, _reduce([e[i] for e in every], a.get("reduceOp", 1, "sum"), t))


class _Args:
    """A call's arguments by name (keyword) or position."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs

    def get(self, name: str, pos: int, default: Any = None) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[pos] if 0 <= pos < len(self.args) else default

    def member(self, info: Any, name: str, pos: int, group_name: str) -> int:
        """The member index of a root given as a global rank (``name``) or as a group rank (``group_name``)."""
        rank = self.get(name, pos)
        return info.ranks.index(int(rank)) if rank is not None else int(self.get(group_name, -1, 0))


def portable(value: Any) -> Any:
    """What travels through the mailbox: a tensor as a compact CPU copy of its own elements (pickling a view sends
    its whole storage), lists element by element."""
    if isinstance(value, torch.Tensor):
        return _raw(value).detach().to("cpu").contiguous().clone()
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value
