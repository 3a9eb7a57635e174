"""Seeing every collective on a registered group: torch.distributed's functions wrapped while the doctor is on.

While a :class:`~megashard.doctor.watch.Doctor` is installed, the collective and point-to-point functions of
``torch.distributed`` (the names in :data:`COLLECTIVES` and :data:`POINT_TO_POINT` that this torch has) are replaced,
in the ``torch.distributed`` namespace *and* in ``torch.distributed.distributed_c10d`` (so that ``P2POp(dist.isend,
...)`` passes torch's own check that its op is ``isend``), by wrappers that

1. look the ``group`` argument up by identity in the ledger (``None`` = the default group) — a group the doctor does
   not know goes straight through;
2. count the call on the group (:meth:`Ledger.begin <megashard.doctor.ledger.Ledger.begin>`: an integer and a small
   object, no store, no lock), call torch, and close it when it returns — an ``async_op=True`` call (and
   ``isend``/``irecv``/``batch_isend_irecv``) stays open until the background thread sees its Work
   ``is_completed()`` or the caller's ``Work.wait()`` returns (wrapped too: the Work is let go at once); on NCCL a
   synchronous call is only enqueued when it returns, so a CUDA event recorded after it tells when it finished;
3. when torch raises (gloo's timeout, a peer that died), let the doctor diagnose before the error goes on.

Calls made *inside* a wrapped call (``all_gather_object`` → ``all_gather``; ``batch_isend_irecv`` → ``isend``) are
not counted again (a thread-local depth). Functional collectives (``torch.distributed._functional_collectives``: what
DTensor's redistribution calls) are wrapped at their Python entry points; one on a group the doctor was not told of
(a DeviceMesh the user made) adopts that group, named after its mesh axis (:meth:`Doctor.adopt_functional
<megashard.doctor.watch.Doctor.adopt_functional>`). The main thread's moves into and out of every call (entry, return,
``Work.wait``, ``wait_tensor``) are written to the rank's entry slot (:mod:`megashard.doctor.board`). Not seen:
collectives compiled by ``torch.compile``, collectives called through a name imported before the doctor was installed
(``from torch.distributed import all_reduce``), and ProcessGroup methods called directly (``pg.allreduce(...)``).
"""
from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["COLLECTIVES", "POINT_TO_POINT", "CallSpec", "install", "install_recorder", "uninstall", "installed"]

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced",
    "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce",
    "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "all_gather_object",
    "gather_object", "broadcast_object_list", "scatter_object_list",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")

_ACTIVE: list = [None]  # the installed Doctor
_RECORDER: list = [None]  # the installed recorder (megashard.rehearse): sees every call first, doctor or not
_ORIGINALS: dict[str, Callable] = {}
_FUNCTIONAL: dict[str, Callable] = {}  # torch.distributed._functional_collectives' own functions, while wrapped
_UNDO: list = []
_TLS = threading.local()


def installed() -> bool:
    return bool(_ORIGINALS or _FUNCTIONAL)


def _param_index(fn: Callable, name: str) -> int:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return -1
    return params.index(name) if name in params else -1


def _arg(args: tuple, kwargs: dict, name: str, idx: int, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[idx] if 0 <= idx < len(args) else default


class _EventProbe:
    """``is_completed()`` of a CUDA event recorded after an enqueued NCCL call (no tensor kept alive)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        import torch

        self.event = torch.cuda.Event()
        self.event.record()

    def is_completed(self) -> bool:
        return self.event.query()


_TENSOR_PARAMS = ("tensor", "input_tensor", "input", "tensors", "input_tensor_list", "output_tensor", "output")
_SIGS: dict = {}  # (dtype, shape, list length) -> its text


def _sig(t: Any) -> str:
    """``float32[4, 8]`` for a tensor (``float32[4]×3`` for a list of them), "" for anything else. About a µs: the
    text of a (dtype, shape) seen before is looked up."""
    n = 1
    if isinstance(t, (list, tuple)):
        n = len(t)
        t = t[0] if t else None
    shape = getattr(t, "shape", None)
    if shape is None:
        return ""
    key = (t.dtype, shape, n)
    text = _SIGS.get(key)
    if text is None:
        if len(_SIGS) > 4096:  # a job with ever new shapes: start over
            _SIGS.clear()
        text = _SIGS[key] = str(t.dtype).replace("torch.", "") + str(list(shape)) + (f"×{n}" if n > 1 else "")
    return text


def _p2p_parts(name: str, args: tuple, kwargs: dict, track: Any, idx: dict) -> tuple[tuple[str, int], ...]:
    direction = "send" if "send" in name else "recv"
    peer = _arg(args, kwargs, "dst" if direction == "send" else "src", idx["peer"])
    if peer is None:
        gpeer = kwargs.get("group_dst" if direction == "send" else "group_src")
        peer = track.ranks[gpeer] if gpeer is not None and 0 <= gpeer < len(track.ranks) else -1
    return ((direction, int(peer)),)


class CallSpec:
    """What a wrapper knows about the torch function it wraps: its name, the function, and where its arguments sit
    (``idx``: parameter name -> position, -1 when absent). Handed to a recorder with each call."""

    __slots__ = ("name", "fn", "idx", "tensor_param", "p2p", "always_async", "functional")

    def __init__(self, name: str, fn: Callable, idx: dict, tensor_param: Any, p2p: bool, always_async: bool,
                 functional: bool = False) -> None:
        self.name, self.fn, self.idx, self.tensor_param = name, fn, idx, tensor_param
        self.p2p, self.always_async, self.functional = p2p, always_async, functional

    def arg(self, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
        """The argument ``name`` of a call (``"group"``, ``"async"`` for ``async_op``, ``"peer"``, ``"tensor"``)."""
        key = {"async": "async_op", "tensor": self.tensor_param}.get(name, name)
        if name == "peer":
            key = "dst" if "send" in self.name else "src"
        return _arg(args, kwargs, key, self.idx.get(name, -1), default)


def _recorded(recorder: Any, spec: CallSpec, args: tuple, kwargs: dict) -> Any:
    """A call while a recorder is installed: the recorder records it and runs (or stands in for) torch's function;
    calls made inside it are torch's own (not recorded again)."""
    _TLS.depth = 1
    try:
        return recorder.call(spec, args, kwargs)
    finally:
        _TLS.depth = 0


def _wrap(name: str, fn: Callable) -> Callable:
    p2p = name in POINT_TO_POINT
    idx = {"group": _param_index(fn, "group"), "async": _param_index(fn, "async_op"),
           "peer": _param_index(fn, "dst" if "send" in name else "src")}
    tensor_param = next((p for p in _TENSOR_PARAMS if _param_index(fn, p) >= 0), None)
    idx["tensor"] = _param_index(fn, tensor_param) if tensor_param else -1
    always_async = name in ("isend", "irecv", "batch_isend_irecv")
    spec = CallSpec(name, fn, idx, tensor_param, p2p, always_async)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        recorder = _RECORDER[0]
        if recorder is not None and not getattr(_TLS, "depth", 0):
            return _recorded(recorder, spec, args, kwargs)
        doctor = _ACTIVE[0]
        if doctor is None or getattr(_TLS, "depth", 0):
            return fn(*args, **kwargs)
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list")
            group = ops[0].group if ops else None
        else:
            ops = None
            group = _arg(args, kwargs, "group", idx["group"])
        ledger = doctor.ledger
        track = ledger.tracks.get(0 if group is None else id(group))
        if track is None or (group is not None and track.pg is not group):
            if group is not None:  # a group of another layout's grid? (named once: megashard.doctor.foreign)
                from megashard.doctor.foreign import note_foreign

                note_foreign(doctor, group, name, _sig(_arg(args, kwargs, tensor_param, idx["tensor"]))
                             if tensor_param else "")
            return fn(*args, **kwargs)
        if ops is not None:
            parts = tuple(("send" if "send" in getattr(o.op, "__name__", "") else "recv", int(o.peer)) for o in ops)
        elif p2p:
            parts = _p2p_parts(name, args, kwargs, track, idx)
        else:
            parts = ()
        sig = _sig(_arg(args, kwargs, tensor_param, idx["tensor"])) if tensor_param else ""
        call = ledger.begin(track, name, parts, sig)
        doctor.entered(call)  # before torch runs it: a rank that dies inside is seen inside
        _TLS.depth = 1
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            _TLS.depth = 0
            doctor.on_error(call, e)  # while the call is still open in the published record
            ledger.end(call)
            doctor.returned(call)
            raise
        _TLS.depth = 0
        if always_async or _arg(args, kwargs, "async_op", idx["async"], False):
            if out is None:
                ledger.end(call)
                doctor.returned(call)
            else:
                ledger.hold(call, out)
                doctor.returned(call, in_flight=True)  # back in the caller's code; the call goes on
        elif track.cuda:
            call.work = _EventProbe()
            doctor.returned(call, in_flight=True)  # enqueued
        else:
            ledger.end(call, sync=True)
            doctor.returned(call)  # one byte of the entry slot: not inside any more
        return out

    wrapper._megashard_doctor = True  # type: ignore[attr-defined]
    return wrapper


class _TensorProbe:
    """An output of a functional collective still in flight: finished when ``wait_tensor`` is called on it (the
    caller's first use of the result) or when it was freed unused (``is_completed``)."""

    __slots__ = ("keys", "ref")

    def __init__(self, raw: Any, wrapped: Any) -> None:
        import weakref

        elem = getattr(wrapped, "elem", None)
        self.keys = (id(raw),) if elem is None or elem is raw else (id(raw), id(elem))
        self.ref = weakref.ref(raw)

    def is_completed(self) -> bool:
        return self.ref() is None

    def exception(self) -> None:
        return None


def _on_functional_output(raw: Any, wrapped: Any) -> None:
    outs = getattr(_TLS, "outputs", None)
    if outs is not None and _ACTIVE[0] is not None:
        try:
            outs.append(_TensorProbe(raw, wrapped))
        except TypeError:  # not weak-referenceable (a traced value): nothing to wait for
            pass


def _wrap_functional(name: str, fn: Callable) -> Callable:
    """A functional collective (``funcol.all_reduce``, what DTensor's redistribution calls): counted on its group
    (resolved from a ProcessGroup, a mesh dimension, ranks or a name) like any collective; open until its output is
    waited on (``wait_tensor``: the first use of the result) or freed."""
    from megashard._compat import functional_group_name

    gidx, tidx = _param_index(fn, "group"), _param_index(fn, "self")
    if tidx < 0:
        tidx = _param_index(fn, "inputs")
    tag_idx = _param_index(fn, "tag")

    spec = CallSpec(name, fn, {"group": gidx, "tensor": tidx, "tag": tag_idx, "async": -1, "peer": -1},
                    "self" if _param_index(fn, "self") >= 0 else "inputs", False, False, functional=True)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        recorder = _RECORDER[0]
        if recorder is not None and not getattr(_TLS, "depth", 0):
            return _recorded(recorder, spec, args, kwargs)
        doctor = _ACTIVE[0]
        if doctor is None or getattr(_TLS, "depth", 0):
            return fn(*args, **kwargs)
        try:
            key = functional_group_name(_arg(args, kwargs, "group", gidx), _arg(args, kwargs, "tag", tag_idx, ""))
        except Exception:  # noqa: BLE001 - a group torch itself will refuse: its own error, unseen
            return fn(*args, **kwargs)
        ledger = doctor.ledger
        track = ledger.by_pg_name.get(key)
        if track is None:  # a group of the user's own (a DeviceMesh's): watched from now on, by its axis name
            track = doctor.adopt_functional(key, _arg(args, kwargs, "group", gidx))
            if track is None:
                return fn(*args, **kwargs)
        call = ledger.begin(track, name, (), _sig(_arg(args, kwargs, "self", tidx)))
        doctor.entered(call)
        _TLS.depth, _TLS.outputs = 1, []
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:
            _TLS.depth, _TLS.outputs = 0, None
            doctor.on_error(call, e)
            ledger.end(call)
            doctor.returned(call)
            raise
        probes, _TLS.depth, _TLS.outputs = _TLS.outputs, 0, None
        if probes:
            ledger.hold(call, probes)
            doctor.returned(call, in_flight=True)  # open until its result is waited on
        else:  # waited inside (traced, or a gather along another dim)
            ledger.end(call)
            doctor.returned(call)
        return out

    wrapper._megashard_doctor = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_wait_tensor(fn: Callable) -> Callable:
    """``funcol.wait_tensor``: the output of a functional collective is used: its call closes."""

    @functools.wraps(fn)
    def wait_tensor(tensor: Any) -> Any:
        doctor = _ACTIVE[0]
        call = doctor.ledger.held.get(id(tensor)) if doctor is not None else None
        if call is None:  # not a call the doctor holds (or the doctor is off)
            return fn(tensor)
        doctor.entered(call)  # the main thread waits in it now
        t0 = time.monotonic()
        try:
            out = fn(tensor)
        except BaseException as e:  # gloo's timeout, a lost peer: the call is diagnosed while still open
            doctor.on_error(call, e)
            doctor.returned(call, in_flight=True)
            raise
        doctor.ledger.blocked(id(tensor), time.monotonic() - t0)
        doctor.ledger.waited(tensor)
        doctor.returned(call, in_flight=call.cid in doctor.ledger.open)
        return out

    wait_tensor._megashard_doctor = True  # type: ignore[attr-defined]
    return wait_tensor


def _wrap_wait(fn: Callable) -> Callable:
    """``Work.wait``: a Work waited on successfully closes its call at once, and the ledger lets it go — a Work
    keeps its tensors (gloo's send and receive buffers, a pipeline's activations) alive, and the doctor must not hold
    them past the caller's ``wait()`` (the background poll alone would, for up to its interval). A wait that raises
    or times out leaves the call open, as the diagnosis needs it."""

    @functools.wraps(fn)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        doctor = _ACTIVE[0]
        call = doctor.ledger.held.get(id(self)) if doctor is not None else None
        if call is None:  # torch's own wait inside a synchronous call, or a Work the doctor does not hold
            return fn(self, *args, **kwargs)
        doctor.entered(call)  # the main thread waits in it now
        t0 = time.monotonic()
        try:
            out = fn(self, *args, **kwargs)
        except BaseException as e:  # gloo's timeout, a lost peer: diagnosed while the call is still open
            doctor.on_error(call, e)
            doctor.returned(call, in_flight=True)
            raise
        if out is not False:
            doctor.ledger.blocked(id(self), time.monotonic() - t0)
            doctor.ledger.waited(self)
        doctor.returned(call, in_flight=call.cid in doctor.ledger.open)
        return out

    wait._megashard_doctor = True  # type: ignore[attr-defined]
    return wait


def install(doctor: Any) -> None:
    """Wrap torch.distributed's collectives for ``doctor`` (one doctor per process)."""
    if _ACTIVE[0] is not None and _ACTIVE[0] is not doctor:
        raise RuntimeError("another hang doctor is installed in this process: disable it first")
    _ACTIVE[0] = doctor
    _wrap_all()


def install_recorder(recorder: Any) -> None:
    """Wrap torch.distributed's collectives (as for the doctor) and hand every call to ``recorder.call(spec, args,
    kwargs)`` first (:mod:`megashard.rehearse`: a rank rehearsed without peers records its calls). ``None`` removes
    the recorder; the wrappers stay until :func:`uninstall`."""
    _RECORDER[0] = recorder
    if recorder is not None:
        _wrap_all()


def _wrap_all() -> None:
    if _ORIGINALS:
        return
    for name in (*COLLECTIVES, *POINT_TO_POINT):
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_megashard_doctor", False):
            continue
        _ORIGINALS[name] = fn
        w = _wrap(name, fn)
        setattr(c10d, name, w)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, w)
    wait = getattr(dist.Work, "wait", None)
    if wait is not None and not getattr(wait, "_megashard_doctor", False):
        _ORIGINALS["Work.wait"] = wait
        dist.Work.wait = _wrap_wait(wait)
    _install_functional()


def _install_functional() -> None:
    from megashard._compat import FUNCTIONAL_COLLECTIVES, functional_collectives, hook_functional_outputs

    funcol = functional_collectives()
    if funcol is None:
        return
    undo = hook_functional_outputs(_on_functional_output)
    if undo is None:  # no way to see the outputs: the calls could never be closed
        return
    _UNDO.append(undo)
    for name in (*FUNCTIONAL_COLLECTIVES, "wait_tensor"):
        fn = getattr(funcol, name, None)
        if fn is None or getattr(fn, "_megashard_doctor", False):
            continue
        _FUNCTIONAL[name] = fn
        setattr(funcol, name, _wrap_wait_tensor(fn) if name == "wait_tensor" else _wrap_functional(name, fn))


def uninstall() -> None:
    """Put torch.distributed's own functions back."""
    from megashard.doctor.foreign import forget

    _ACTIVE[0] = None
    _RECORDER[0] = None
    forget()
    for name, fn in _ORIGINALS.items():
        if name == "Work.wait":
            dist.Work.wait = fn
            continue
        if getattr(getattr(dist, name, None), "_megashard_doctor", False):
            setattr(dist, name, fn)
        setattr(c10d, name, fn)
    _ORIGINALS.clear()
    funcol = None
    if _FUNCTIONAL:
        from megashard._compat import functional_collectives

        funcol = functional_collectives()
    for name, fn in _FUNCTIONAL.items():
        if getattr(getattr(funcol, name, None), "_megashard_doctor", False):
            setattr(funcol, name, fn)
    _FUNCTIONAL.clear()
    while _UNDO:
        _UNDO.pop()()
