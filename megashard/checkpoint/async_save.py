"""Checkpoints written in the background: ``checkpoint.async: true`` (DCP's ``async_save``), with every guarantee of
:func:`megashard.checkpoint.save`.

    saver = AsyncSaver()
    saver.save(root, step, sections=sd, keep_last=2)   # returns once the state is copied to host memory
    ...                                                # training goes on while the copy is written
    saver.wait()                                       # the end of training (and the next save) waits for it

What the caller waits for (the *blocked* time, :attr:`AsyncSaver.last_blocked_s`): the previous save, if it still
runs; step 0 of the save (every rank's state dict, checked and agreed on; the temporary directory made); staging
(a copy of every tensor into host buffers reused from save to save — DCP's ``DefaultStager`` for accelerator
tensors — plus the uneven-shard layouts). Then
``torch.distributed.checkpoint.async_save`` writes the copy from a background thread, hashing every file and
storage item as it writes (:class:`~megashard.checkpoint.storage.ChecksummingFileSystemWriter`), and a second
background thread finishes as the synchronous save does: rank-state files, the layout file, the completion marker
last, the atomic rename and retention (:func:`megashard.checkpoint.saving.finish`). Background collectives run on a
process group of their own (gloo), so they never interleave with the training's collectives.

At most one save is in flight: :meth:`AsyncSaver.save` and :meth:`AsyncSaver.wait` first wait for the previous
one and raise its error (a :class:`~megashard.errors.CheckpointError` naming the step). A process killed while a
background write runs leaves only a ``.tmp-`` directory: the previous checkpoint stays the newest complete one
(and the next save removes the leftover).
"""
from __future__ import annotations

import copy
import threading
import time
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import async_save as dcp_async_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from megashard._compat import dcp_default_stager_reusable
from megashard.checkpoint.collective import dist_on, unwrap_dcp_error
from megashard.checkpoint.planners import MegashardSavePlanner
from megashard.checkpoint.saving import finish, start
from megashard.checkpoint.state_dict import attach_uneven_layouts
from megashard.checkpoint.storage import ChecksummingFileSystemWriter
from megashard.errors import CheckpointError, MegashardError

__all__ = ["AsyncSaver"]


class _HostStager(AsyncStager):
    """A copy of the state dict in host memory, with the uneven-shard layouts attached to the copy's DTensors
    (collective over their meshes: it runs in the caller's thread).

    CPU tensors are copied into host buffers kept from the previous save (same keys, shapes and dtypes: no
    allocation, no page faults — the caller waits for the previous save before staging again); a state dict with
    tensors on an accelerator goes through DCP's ``DefaultStager``.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._layouts: dict = {}  # the uneven-shard layouts of the previous save (reused when nothing changed)
        self._default: Optional[DefaultStager] = None

    def stage(self, state_dict: dict) -> dict:
        if self._on_host(state_dict):
            staged = self._copy(state_dict, "")
        else:
            staged = self._default_stager().stage(state_dict)
        attach_uneven_layouts(staged, cache=self._layouts)
        return staged

    @staticmethod
    def _on_host(state_dict: dict) -> bool:
        """True if every tensor is on the CPU (megashard's own copy); else DCP's ``DefaultStager`` copies."""
        return all(t.device.type == "cpu" for t in _tensors(state_dict))

    def _default_stager(self) -> DefaultStager:
        """The ``DefaultStager`` of this save: kept from save to save (its host copies are reused) where torch's
        stager survives a ``stage()``; a fresh one per save where ``stage()`` closes it (torch 2.11)."""
        if self._default is not None and not dcp_default_stager_reusable():
            self._default.close()  # the previous save's copy is written: the caller waited for it
            self._default = None
        if self._default is None:
            self._default = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                         use_async_staging=False, use_non_blocking_copy=False))
        return self._default

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype)
        return buf.copy_(t)

    def _copy(self, x: Any, key: str) -> Any:
        if isinstance(x, DTensor):
            return DTensor.from_local(self._buffer(key, x.to_local()), x.device_mesh, x.placements, run_check=False,
                                      shape=x.shape, stride=x.stride())
        if isinstance(x, torch.Tensor):
            return self._buffer(key, x.detach())
        if isinstance(x, dict):
            return {k: self._copy(v, f"{key}/{k}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self._copy(v, f"{key}/{i}") for i, v in enumerate(x))
        return copy.deepcopy(x)

    def synchronize_staging(self) -> None:  # staging is synchronous
        pass

    def close(self) -> None:
        self._buffers.clear()
        if self._default is not None:
            self._default.close()


def _tensors(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


class _Pending:
    """One background save: its thread and its outcome."""

    def __init__(self, step: int, final: str, root: str) -> None:
        self.step, self.final, self.root = step, final, root
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None


class AsyncSaver:
    """Background checkpoint saves, at most one in flight (all ranks of the default group call every method)."""

    #: The storage writer class (tests substitute a slow one to kill a job during a background write).
    writer_class = ChecksummingFileSystemWriter

    def __init__(self) -> None:
        self._group: Optional[dist.ProcessGroup] = None
        self._pending: Optional[_Pending] = None
        self._stager = _HostStager()
        self.last_blocked_s = 0.0
        """Seconds the last :meth:`save` kept its caller waiting (waiting for the previous save included)."""
        self.last_phases: dict[str, float] = {}
        """Where :attr:`last_blocked_s` went (seconds): ``wait_previous``, ``agree_and_directory`` (step 0),
        ``stage_and_start``."""

    def _background_group(self) -> Optional[dist.ProcessGroup]:
        """A gloo group of every rank for the background collectives (made at the first save, on every rank)."""
        if dist_on() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(self, root: str, step: int, *, sections: dict, consumed_samples: Optional[int] = None,
             keep_last: Optional[int] = None, checksum: str = "crc32", overwrite: bool = False, parallel_state=None,
             sync_files: bool = True, thread_count: int = 1, job: Optional[dict] = None,
             run_id: Optional[str] = None) -> str:
        """Start saving ``sections`` as the checkpoint of ``step`` under ``root``; returns its (future) path.

        Arguments as for :func:`megashard.checkpoint.save`. Returns once the state is staged in host memory; the
        checkpoint is complete (marker written, directory renamed, retention applied) when :meth:`wait` returns.
        """
        t0 = time.perf_counter()
        self.wait()
        phases = {"wait_previous": time.perf_counter() - t0}
        t = time.perf_counter()
        root, final, tmp, sd, layout = start(root, step, keep_last=keep_last, checksum=checksum, overwrite=overwrite,
                                             parallel_state=parallel_state, sections=sections)
        phases["agree_and_directory"] = time.perf_counter() - t
        group = self._background_group()
        if not dist_on():  # DCP's writer thread warns that one process is assumed: intended (warnings are global)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer = self.writer_class(tmp, checksum, sync_files=sync_files, thread_count=thread_count)
        t = time.perf_counter()
        try:
            with warnings.catch_warnings():  # DCP: "torch.distributed is disabled" (one process) and "experimental"
                warnings.simplefilter("ignore")
                future = dcp_async_save(sd, storage_writer=writer, planner=MegashardSavePlanner(), process_group=group,
                                        async_stager=self._stager, no_dist=not dist_on())
        except CheckpointException as e:
            raise unwrap_dcp_error(e) from None
        phases["stage_and_start"] = time.perf_counter() - t
        pending = _Pending(step, final, root)

        def complete() -> None:
            try:
                try:
                    metadata = future.result()
                except CheckpointException as e:
                    raise unwrap_dcp_error(e) from None
                finish(writer, metadata, sd, root=root, final=final, tmp=tmp, step=step, checksum=checksum,
                       overwrite=overwrite, keep_last=keep_last, consumed_samples=consumed_samples, data_state=None,
                       layout=layout, job=job, group=group, run_id=run_id)
            except BaseException as e:  # noqa: BLE001 - reported by wait()
                pending.error = e

        pending.thread = threading.Thread(target=complete, name=f"megashard-async-save-{step}", daemon=True)
        pending.thread.start()
        self._pending = pending
        self.last_blocked_s = time.perf_counter() - t0
        self.last_phases = phases
        return final

    @property
    def in_flight(self) -> bool:
        """True while a background save runs."""
        return self._pending is not None and self._pending.thread.is_alive()

    def wait(self) -> Optional[str]:
        """Wait for the save in flight (if any); returns its path, or raises its error as a CheckpointError."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.thread.join()
        if pending.error is not None:
            e = pending.error
            what = str(e) if isinstance(e, MegashardError) else f"{type(e).__name__}: {e}"
            raise CheckpointError(f"the background save of step {pending.step} ({pending.final}) failed: {what}; "
                                  f"the previous complete checkpoint in {pending.root} is still the newest that "
                                  "loads") from e
        return pending.final

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then release the stager and the background group."""
        try:
            self.wait()
        finally:
            self._stager.close()
            if self._group is not None and dist_on():
                dist.destroy_process_group(self._group)
            self._group = None
