"""What one rehearsed rank calls: every collective and point-to-point operation, with its group, peers, dtype, shape,
order and the line of code that issued it.

A :class:`Recorder` is installed in the rank's process through the doctor's interception
(:func:`megashard.doctor.intercept.install_recorder`: the same wrappers of ``torch.distributed``'s functions and of
the functional collectives DTensor uses). For every call it

1. names the group (:class:`GroupInfo`: megashard's name and the layout that made it, from every live
   :class:`~megashard.state.ParallelState`; else torch's description of the group and its global ranks);
2. records a :class:`CallRecord` (operation, group, peer, ``float32[4096]``, asynchronous or not, source line);
3. runs torch's function (the ``fake`` backend: returns at once, moves no data) — except where a value must come
   from a peer for the rank to go on: object collectives are answered locally (``all_gather_object`` gives every
   slot this rank's object), and a receive takes the peer's message from the rehearsal's mailbox
   (:class:`~megashard.rehearse.broker.Channel`: small tensors and objects carry their values, so a pipeline's
   metadata and probe see what the peer sent); a receive whose message is not there yet waits for the peer rank.

Shapes that depend on data — ``all_to_all`` with split sizes (MoE token routing), object collectives (pickled sizes)
— are marked ``data_dependent``: their order and group are checked, their shape is not.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["CallRecord", "GroupInfo", "Recorder", "Unmatched", "OBJECT_P2P"]

#: Object point-to-point functions the recorder wraps itself (the doctor does not watch them).
OBJECT_P2P = ("send_object_list", "recv_object_list")
#: Elements up to which a sent tensor's values travel through the mailbox (pipeline metadata, probes, votes).
PAYLOAD_MAX_NUMEL = 4096
_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


class Unmatched(BaseException):
    """Raised in a rehearsed rank whose receive can never be matched (the rehearsal found no rank left to send it):
    a BaseException, so that a user's ``except Exception`` does not swallow it."""

    def __init__(self, src: int, dst: int, k: int, why: str):
        super().__init__(f"rank {dst}: receive #{k} from rank {src} never matched ({why})")
        self.src, self.dst, self.k, self.why = src, dst, k, why


@dataclass(frozen=True)
class GroupInfo:
    """A process group as every member names it: ``key`` (name and global ranks: the same on every member), its
    megashard name, its global ranks and the layouts it belongs to (labels of the ParallelStates that hold it)."""

    key: str
    name: str
    ranks: tuple[int, ...]
    layouts: tuple[str, ...] = ()


@dataclass(slots=True)
class CallRecord:
    """One operation a rank issued. ``kind``: ``coll`` (a collective), ``send`` or ``recv`` (point-to-point; one
    record per operation of a batch)."""

    group: str
    """:attr:`GroupInfo.key` of its group."""
    op: str
    sig: str
    """``float32[4096]`` (``×n`` for a list of tensors), "" for object and barrier calls."""
    kind: str = "coll"
    peer: int = -1
    """Point-to-point: the other rank (global); -1 for any source."""
    async_op: bool = False
    site: str = ""
    """``file:line (function)`` of the innermost frame outside torch and megashard's interception."""
    data_dependent: bool = False
    """Its shape depends on data (split sizes, pickled objects): the shape is not compared, order and group are."""
    note: str = ""
    """A finding of the recorder itself on this call (a group of another layout than the current one)."""


@dataclass
class RankTrace:
    """Everything one rehearsed rank recorded: its calls in order, the groups they name, how it ended."""

    rank: int
    world_size: int
    calls: list[CallRecord] = field(default_factory=list)
    groups: dict[str, GroupInfo] = field(default_factory=dict)
    status: str = "ok"
    """``ok``; ``blocked`` (a receive never matched: :attr:`blocked`); ``error`` (:attr:`error`)."""
    error: str = ""
    blocked: Optional[tuple[int, int, str]] = None
    """``(src, k, why)`` of the receive this rank was left waiting in."""
    result: Any = None
    """What the caller's ``result`` hook returned in the rank's process (picklable)."""
    seconds: float = 0.0


_SKIP_DIRS: tuple[str, ...] = ()


def _skip_dirs() -> tuple[str, ...]:
    global _SKIP_DIRS
    if not _SKIP_DIRS:
        here = os.path.dirname(os.path.abspath(__file__))
        pkg = os.path.dirname(here)
        dirs = [os.path.dirname(torch.__file__), here, os.path.join(pkg, "doctor"), os.path.join(pkg, "_compat"),
                sysconfig.get_paths().get("stdlib", "/nonexistent")]
        _SKIP_DIRS = tuple(os.path.join(os.path.realpath(d), "") for d in dirs)
    return _SKIP_DIRS


_SITES: dict[tuple, str] = {}


def call_site(depth: int = 2) -> str:
    """``path:line (function)`` of the innermost frame outside torch, the standard library and megashard's
    interception (relative to the current directory when below it)."""
    skip = _skip_dirs()
    f = sys._getframe(depth)
    while f is not None:
        code = f.f_code
        fn = code.co_filename
        key = (fn, f.f_lineno)
        text = _SITES.get(key)
        if text is not None:
            return text
        real = os.path.realpath(fn) if not fn.startswith("<") else fn
        if not real.startswith(skip):
            rel = os.path.relpath(real) if real.startswith(os.getcwd() + os.sep) else real
            text = _SITES[key] = f"{rel}:{f.f_lineno} ({code.co_name})"
            return text
        f = f.f_back
    return "?"


from megashard.rehearse.works import (  # noqa: E402
    DeferredRecv as _DeferredRecv,
    DoneWork as _DoneWork,
    SentWork as _SentWork,
)


def _sig(t: Any) -> str:
    from megashard.doctor.intercept import _sig as sig

    return sig(t)


def _as_from_a_peer_like_this_rank(args: tuple, kwargs: dict) -> None:
    """An even ``all_to_all_single`` (no split sizes) receives what this rank sends, as if every peer were like it —
    what the ``fake`` backend of torch 2.13+ does itself; torch 2.11's leaves the output as allocated, and MoE's
    exchange of pair counts then sizes a tensor from uninitialised memory. Uneven ones (their sizes given) keep the
    backend's output: its values route the next MoE layer's tokens, so zeros would send every token to one expert
    and change what a traced rank holds."""
    names = ("output", "input", "output_split_sizes", "input_split_sizes")
    given = dict(zip(names, args))
    given.update({k: v for k, v in kwargs.items() if k in names})
    out, inp = given.get("output"), given.get("input")
    if not (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)) or out is inp:
        return
    if (given.get("output_split_sizes") is None and given.get("input_split_sizes") is None
            and out.numel() == inp.numel()):
        with torch.no_grad():
            out.copy_(inp.reshape(out.shape))


class Recorder:
    """The calls of rank ``rank`` (see the module docstring); ``channel``: the rehearsal's mailbox (None: receives
    are not waited for and get no values); ``exact``: every collective is answered with its peers' values through the
    channel (:mod:`megashard.rehearse.exact`: every rank of the world rehearsed together) and every message carries
    its values."""

    def __init__(self, rank: int, world_size: int, channel: Any = None, exact: bool = False):
        self.trace = RankTrace(rank, world_size)
        self.rank = rank
        self.world_size = world_size
        self.channel = channel
        self.exchange = None
        if exact and channel is not None:
            from megashard.rehearse.exact import Exchange

            self.exchange = Exchange(self)
        self._groups: dict[int, tuple[Any, GroupInfo]] = {}
        self._sent: dict[int, int] = {}  # peer -> sends to it so far
        self._recvd: dict[int, int] = {}  # peer -> receives from it so far
        self._coll_seq: dict[str, int] = {}  # group key -> collectives recorded on it
        self._object_originals: dict[str, Any] = {}
        self.max_calls: Optional[int] = None

    # ------------------------------------------------------------------ installing
    def install(self) -> None:
        """Record every call of this process from now on (the doctor's wrappers, plus the object p2p functions)."""
        from torch.distributed import distributed_c10d as c10d

        from megashard.doctor import intercept

        intercept.install_recorder(self)
        for name in OBJECT_P2P:
            fn = getattr(c10d, name, None)
            if fn is None or name in self._object_originals:
                continue
            self._object_originals[name] = fn
            wrapped = self._object_p2p_wrapper(name, fn)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is fn:
                setattr(dist, name, wrapped)

    def uninstall(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        from megashard.doctor import intercept

        intercept.uninstall()
        for name, fn in self._object_originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        self._object_originals.clear()

    # ------------------------------------------------------------------ groups
    def group_info(self, pg: Any) -> GroupInfo:
        """The :class:`GroupInfo` of process group ``pg`` (None: the default group)."""
        if pg is None:
            pg = dist.group.WORLD
        hit = self._groups.get(id(pg))
        if hit is not None and hit[0] is pg:
            return hit[1]
        info = self._describe(pg)
        self._groups[id(pg)] = (pg, info)
        self.trace.groups[info.key] = info
        return info

    def _describe(self, pg: Any) -> GroupInfo:
        from megashard.state.identity import layouts_of

        world = dist.group.WORLD
        if pg is world:
            return GroupInfo("world", "world", tuple(range(self.world_size)), ())
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        names, layouts = layouts_of(pg)
        if names:  # megashard's communicators are one per rank set: the ranks name it (its names vary by layout)
            name = min(names, key=lambda n: (len(n), n))  # dp (not dp_cp) for the one communicator of both
            key = f"g:{_ranks_key(ranks)}"
        else:
            desc = str(getattr(pg, "group_desc", "") or "")
            name = desc.split(":", 1)[1] if desc.startswith("megashard:") else (desc if desc and
                                                                                 not desc.startswith("undefined") else "group")
            key = f"{name}:{_ranks_key(ranks)}"
        return GroupInfo(key, name, ranks, layouts)

    def _wrong_grid(self, pg: Any, info: GroupInfo) -> str:
        """A note when ``pg`` is a group of a megashard layout that is not the current one (what the hang doctor says
        at run time too: :func:`megashard.state.identity.foreign_group_note`)."""
        if not info.layouts:
            return ""
        from megashard.state.identity import foreign_group_note

        return foreign_group_note(pg)

    # ------------------------------------------------------------------ recording
    def _record(self, rec: CallRecord) -> None:
        self.trace.calls.append(rec)
        if self.max_calls is not None and len(self.trace.calls) >= self.max_calls:
            raise Unmatched(-1, self.rank, 0, f"the rehearsal stops after {self.max_calls} calls (--max-calls)")

    def call(self, spec: Any, args: tuple, kwargs: dict) -> Any:
        """A wrapped call (:func:`megashard.doctor.intercept.install_recorder`): record, then run or stand in."""
        name = spec.name
        site = call_site(3)
        if name == "batch_isend_irecv":
            return self._batch(spec, args, kwargs, site)
        group = spec.arg(args, kwargs, "group")
        if spec.functional:
            pg = self._functional_group(group, spec.arg(args, kwargs, "tag", ""))
        else:
            pg = group
        info = self.group_info(pg)
        note = self._wrong_grid(pg, info)
        async_op = bool(spec.always_async or spec.arg(args, kwargs, "async", False))
        if spec.p2p:
            return self._p2p(spec, args, kwargs, info, site, async_op, note)
        tensor = spec.arg(args, kwargs, "tensor") if spec.tensor_param else None
        dd = name in _OBJECT_COLLECTIVES or name == "all_to_all" or (
            "all_to_all" in name and (kwargs.get("output_split_sizes") is not None
                                      or kwargs.get("input_split_sizes") is not None
                                      or (not spec.functional and len(args) > 2 and args[2] is not None)
                                      or (spec.functional and len(args) > 1 and args[1] is not None)))
        self._record(CallRecord(info.key, name, "" if name in _OBJECT_COLLECTIVES else _sig(tensor), "coll",
                                async_op=async_op, site=site, data_dependent=dd, note=note))
        seq = self._coll_seq[info.key] = self._coll_seq.get(info.key, 0) + 1
        if name in _OBJECT_COLLECTIVES:
            return self._object_collective(name, args, kwargs, info, seq)
        if name == "monitored_barrier":
            return None
        if self.exchange is not None:
            if name in ("all_to_all_single", "all_to_all") and not spec.functional:
                # answered by the peers alone: the fake backend refuses what gloo takes (a rank that sends no row
                # but receives some, as the router's choices on a pipeline's shape-inference input can make)
                self.exchange.settle(name, spec, args, kwargs, info, seq, None)
                return _DoneWork() if async_op else None
            return self.exchange.settle(name, spec, args, kwargs, info, seq, spec.fn(*args, **kwargs))
        out = spec.fn(*args, **kwargs)
        if name == "all_to_all_single" and not spec.functional:
            _as_from_a_peer_like_this_rank(args, kwargs)
        return out

    def _functional_group(self, group: Any, tag: Any) -> Any:
        from megashard._compat import functional_group_name, process_group_by_name

        try:
            return process_group_by_name(functional_group_name(group, tag or ""))
        except Exception:  # noqa: BLE001 - torch will name its own error
            return None

    # ------------------------------------------------------------------ object collectives: answered locally
    def _object_collective(self, name: str, args: tuple, kwargs: dict, info: GroupInfo, seq: int) -> Any:
        if name == "all_gather_object":
            out = args[0] if args else kwargs.get("object_list")
            obj = args[1] if len(args) > 1 else kwargs.get("obj")
            every = [obj] * len(out)
            if self.exchange is not None:  # every member's object
                from megashard._compat import no_dispatch_modes

                with no_dispatch_modes():
                    every = self.exchange.gather(info, seq, obj)
            for i in range(len(out)):
                out[i] = every[i]
        elif name == "gather_object":
            obj = args[0] if args else kwargs.get("obj")
            out = args[1] if len(args) > 1 else kwargs.get("object_gather_list")
            if out is not None:
                for i in range(len(out)):
                    out[i] = obj
        elif name == "scatter_object_list":
            out = args[0] if args else kwargs.get("scatter_object_output_list")
            inp = args[1] if len(args) > 1 else kwargs.get("scatter_object_input_list")
            if inp:
                me = info.ranks.index(self.rank) if self.rank in info.ranks else 0
                out[0] = inp[me] if me < len(inp) else inp[0]
        elif name == "broadcast_object_list" and self.channel is not None:  # the source's objects, from the mailbox
            objects = args[0] if args else kwargs.get("object_list")
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if src is None and kwargs.get("group_src") is not None:
                src = info.ranks[kwargs["group_src"]]
            src = 0 if src is None else int(src)
            key = (src, -1, info.key, seq)  # taken by every member (megashard.rehearse.broker)
            if src == self.rank:
                try:
                    import pickle

                    self.channel.put(key, pickle.loads(pickle.dumps(list(objects))))
                except Exception:  # noqa: BLE001 - objects that cannot travel: the others keep their own
                    self.channel.put(key, None)
            else:
                value = self.channel.get(key)
                if isinstance(value, list):
                    objects[:len(value)] = value[:len(objects)]
        return None

    # ------------------------------------------------------------------ point-to-point
    def _p2p(self, spec: Any, args: tuple, kwargs: dict, info: GroupInfo, site: str, async_op: bool,
             note: str) -> Any:
        name = spec.name
        send = "send" in name
        peer = spec.arg(args, kwargs, "peer")
        if peer is None:
            gpeer = kwargs.get("group_dst" if send else "group_src")
            peer = info.ranks[gpeer] if gpeer is not None and 0 <= gpeer < len(info.ranks) else -1
        peer = int(peer)
        tensor = spec.arg(args, kwargs, "tensor")
        self._record(CallRecord(info.key, name, _sig(tensor), "send" if send else "recv", peer, async_op, site,
                                note=note))
        out = spec.fn(*args, **kwargs)
        if send:
            self._post(tensor, peer)
            return _SentWork(tensor, out) if name == "isend" else out  # holds its tensor, as gloo's Work does
        k = self._next(self._recvd, peer)
        if name == "irecv":
            return _DeferredRecv(self, tensor, peer, k)
        self._take(tensor, peer, k)
        return peer if name == "recv" else out

    def _batch(self, spec: Any, args: tuple, kwargs: dict, site: str) -> Any:
        ops = list(args[0] if args else kwargs.get("p2p_op_list") or [])
        works: list[Any] = []
        recvs = []
        for op in ops:  # every send first: a batch's receives never wait for its own sends
            info = self.group_info(op.group)
            send = "send" in getattr(op.op, "__name__", "")
            self._record(CallRecord(info.key, "batch_isend_irecv", _sig(op.tensor), "send" if send else "recv",
                                    int(op.peer), True, site, note=self._wrong_grid(op.group, info)))
            if send:
                self._post(op.tensor, int(op.peer))
            else:
                recvs.append(op)
        spec.fn(*args, **kwargs)
        for op in ops:
            if "send" in getattr(op.op, "__name__", ""):
                works.append(_SentWork(op.tensor))  # holds the sent tensor while the caller holds the Work
            else:
                works.append(_DeferredRecv(self, op.tensor, int(op.peer), self._next(self._recvd, int(op.peer))))
        return works

    @staticmethod
    def _next(counter: dict[int, int], peer: int) -> int:
        k = counter[peer] = counter.get(peer, 0) + 1
        return k

    def _post(self, payload: Any, dst: int, obj: bool = False) -> None:
        k = self._next(self._sent, dst)
        if self.channel is None:
            return
        value = None
        if obj:
            value = payload
        elif isinstance(payload, torch.Tensor) and (self.exchange is not None or payload.numel() <= PAYLOAD_MAX_NUMEL):
            from megashard._compat import no_dispatch_modes
            from megashard.rehearse.exact import portable

            with no_dispatch_modes():  # the transfer's copy is not the program's tensor
                value = portable(payload)
        self.channel.put((self.rank, dst, k), value)

    def _take(self, tensor: Any, src: int, k: int) -> Any:
        if self.channel is None or src < 0:
            return None
        value = self.channel.get((src, self.rank, k))
        if isinstance(value, torch.Tensor) and isinstance(tensor, torch.Tensor) and value.shape == tensor.shape:
            with torch.no_grad():
                tensor.copy_(value.to(tensor.device, tensor.dtype))
        return value

    def _object_p2p_wrapper(self, name: str, fn: Any) -> Any:
        import functools

        recorder = self

        @functools.wraps(fn)
        def wrapper(object_list: list, peer: Optional[int] = None, group: Any = None, device: Any = None,
                    **kwargs: Any) -> Any:
            send = name == "send_object_list"
            if peer is None:
                peer = kwargs.get("dst" if send else "src")
            info = recorder.group_info(group)
            gpeer = kwargs.get("group_dst" if send else "group_src")
            if peer is None and gpeer is not None:
                peer = info.ranks[gpeer]
            peer = -1 if peer is None else int(peer)
            recorder._record(CallRecord(info.key, name, "", "send" if send else "recv", peer, False, call_site(2),
                                        data_dependent=True, note=recorder._wrong_grid(group, info)))
            if send:
                try:
                    import pickle

                    value = pickle.loads(pickle.dumps(list(object_list)))
                except Exception:  # noqa: BLE001 - an object that cannot travel: the receiver gets its own list
                    value = None
                recorder._post(value, peer, obj=True)
                return None
            k = recorder._next(recorder._recvd, peer)
            value = recorder.channel.get((peer, recorder.rank, k)) if recorder.channel is not None and peer >= 0 \
                else None
            if isinstance(value, list):
                object_list[:len(value)] = value[:len(object_list)]
            return peer

        wrapper._megashard_doctor = True  # type: ignore[attr-defined]
        return wrapper


def _ranks_key(ranks: tuple[int, ...]) -> str:
    """``0-7`` / ``0-6/2`` (first-last/stride) for ranks in arithmetic progression, else the list."""
    if len(ranks) == 1:
        return str(ranks[0])
    stride = ranks[1] - ranks[0]
    if stride > 0 and all(b - a == stride for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}-{ranks[-1]}" + (f"/{stride}" if stride != 1 else "")
    return ",".join(map(str, ranks))
