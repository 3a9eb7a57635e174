"""DCP storage with checksums: hashed as it is written, verified as it is read.

Save — :class:`ChecksummingFileSystemWriter`: DCP's ``FileSystemWriter`` whose data-file streams hash the
bytes passing through them, once for the whole file and once per DCP storage item (DCP asks the stream
for its position at the start and end of every item, so the bytes between two such calls are one item).
No file is read back. The records go into the completion marker (:class:`megashard.checkpoint.safety.Marker`,
``files`` and ``items``).

Load — :class:`SafeFileSystemReader`: DCP's ``FileSystemReader`` that checks each file against the marker
before using it, and reads data files item by item: a small thread pool reads the next items' bytes and
hashes them (file reads, ``zlib.crc32`` and ``hashlib`` release the GIL) while the calling thread
deserialises the previous item and copies it into place. An item whose checksum differs raises
:class:`~megashard.errors.CheckpointCorruptedError` naming the file and the item before any of its bytes
are used. Files of older checkpoints (no per-item checksums) are hashed whole before their first use.

Non-tensor data is never unpickled freely: ``.metadata`` goes through :func:`load_dcp_metadata`'s
restricted unpickler, every other object through ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterable, Optional, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from megashard._compat import dcp_metadata_enum_member, dcp_metadata_global_allowed, dcp_narrow_tensor_by_index
from megashard.checkpoint import checksums, safety
from megashard.errors import CheckpointCorruptedError

__all__ = ["ChecksummingFileSystemWriter", "SafeFileSystemReader", "load_dcp_metadata", "DCP_METADATA"]

DCP_METADATA = ".metadata"
DATA_SUFFIX = ".distcp"


# ---------------------------------------------------------------------------------------------- metadata
def _enum_member(owner: Any, name: Any) -> Any:
    """What ``builtins.getattr`` resolves to in a ``.metadata`` pickle: Enum members of DCP classes only."""
    member = dcp_metadata_enum_member(owner, name)
    if member is None:
        what = owner.__qualname__ if isinstance(owner, type) else type(owner).__name__
        raise pickle.UnpicklingError(
            f"getattr({what}, {str(name)[:60]!r}) is not a member of an allow-listed DCP Enum class; attribute "
            "lookup is allowed only for the Enum members in DCP metadata")
    return member


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # the protocol 0-2 name of the module
            module = "builtins"
        if (module, name) == ("builtins", "getattr"):  # Python 3.11.0-3.11.4 pickle Enum members this way
            return _enum_member
        if dcp_metadata_global_allowed(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not a DCP metadata class")


def load_dcp_metadata(path: str) -> Metadata:
    """Unpickle a DCP ``.metadata`` file, allowing only DCP's metadata classes (and their Enum members),
    sizes and dtypes.

    Raises :class:`CheckpointCorruptedError` naming the file if it is damaged or references anything else
    (a crafted file cannot run code).
    """
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointCorruptedError(f"{path}: DCP metadata file is missing") from None
    except Exception as e:  # noqa: BLE001 - pickle raises many types on damaged input
        raise CheckpointCorruptedError(
            f"{path}: DCP metadata cannot be read safely ({type(e).__name__}: {e}); megashard unpickles only DCP's "
            "metadata classes, never arbitrary objects from disk"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptedError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    return md


# ---------------------------------------------------------------------------------------------- save
class _HashingStream:
    """A write-only file wrapper that hashes each span between two ``tell()`` calls, and the whole file.

    With crc32 every byte is hashed once: the file's CRC is combined from the spans' CRCs
    (:func:`megashard.checkpoint.checksums.crc32_combine`); other algorithms keep a second running digest.
    """

    def __init__(self, raw: Any, algorithm: str) -> None:
        self._raw, self._algorithm = raw, algorithm
        self._file = None if algorithm == "crc32" else checksums.new_digest(algorithm)
        self._file_crc = 0
        self._item = checksums.new_digest(algorithm)
        self._pos = self._start = 0
        self.spans: dict[tuple[int, int], str] = {}  # (offset, length) -> checksum

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        if self._file is not None:
            self._file.update(data)
        self._item.update(data)
        self._pos += memoryview(data).nbytes
        return n

    def tell(self) -> int:
        self._cut()
        return self._pos

    def _cut(self) -> None:
        if self._pos > self._start:
            length = self._pos - self._start
            self.spans[(self._start, length)] = self._item.hexdigest()
            if self._file is None:
                self._file_crc = checksums.crc32_combine(self._file_crc, self._item.value, length)
            self._item = checksums.new_digest(self._algorithm)
            self._start = self._pos

    def record(self) -> tuple[dict, dict]:
        self._cut()
        checksum = f"{self._file_crc:08x}" if self._file is None else self._file.hexdigest()
        return {"size": self._pos, "checksum": checksum}, self.spans

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:  # the spans assume sequential writes; a writer that seeks fails loudly (no seek())
        return False

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed


class _HashingFileSystem(FileSystem):
    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.records: dict[str, tuple[dict, dict]] = {}  # data file name -> (file record, spans)

    @contextmanager
    def create_stream(self, path: Any, mode: str):
        if "w" not in mode or not str(path).endswith(DATA_SUFFIX):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw, self.algorithm)
            yield stream
        self.records[os.path.basename(str(path))] = stream.record()


class ChecksummingFileSystemWriter(FileSystemWriter):
    """DCP's file writer, hashing every data file and every storage item in it as they are written.

    After ``dcp.save``, :meth:`checksums` gives the marker records of the data files this rank wrote.
    """

    def __init__(self, path: str, algorithm: str = "crc32", **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem(algorithm)
        self.written: list = []  # this rank's storage infos (offset, length, file) of the items it wrote

    def write_data(self, plan: Any, planner: Any) -> Future:
        """DCP's write, keeping this rank's own write results: where each item went. The metadata ``dcp.save``
        returns is no substitute: torch 2.11's ``finish`` fills ``storage_data`` into a copy of it."""
        fut = super().write_data(plan, planner)

        def keep(done: Future) -> Any:
            results = done.value()
            self.written.extend(getattr(r, "storage_data", None) for r in results)
            return results

        return fut.then(keep)

    def checksums(self, metadata: Optional[Metadata], rank: int) -> tuple[dict, dict]:
        """``(files, items)`` of the data files this rank wrote: ``files[name]`` = ``{"size", "checksum"}``;
        ``items[name]`` = ``[(offset, length, checksum), ...]`` of the DCP storage items in ``name``, for every
        file whose items (this rank's write results, and the save's ``metadata`` where it has them) match the
        hashed spans and tile the file."""
        by_file: dict[str, list] = collections.defaultdict(list)
        infos = list((getattr(metadata, "storage_data", None) or {}).values()) + self.written
        for info in infos:
            if info is not None and hasattr(info, "relative_path"):
                by_file[info.relative_path].append((int(info.offset), int(info.length)))
        files, items = {}, {}
        for name in by_file:  # a file of this rank DCP wrote past the hashing stream: hashed from disk, whole
            if name not in self.fs.records and name.startswith(f"__{rank}_"):
                files[name] = checksums.file_record(os.path.join(str(self.path), name), self.fs.algorithm)
        for name, (record, spans) in self.fs.records.items():
            files[name] = record
            want = sorted(set(by_file.get(name, ())))
            if want and all(w in spans for w in want) and safety.spans_tile(want, record["size"]):
                items[name] = [(o, n, spans[(o, n)]) for o, n in want]
        return files, items


# ---------------------------------------------------------------------------------------------- load
class _MemoryReader(io.RawIOBase):
    """A seekable read-only file over a memoryview, so ``torch.load`` copies straight out of a read buffer."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        dst = memoryview(b).cast("B")
        n = max(0, min(len(dst), len(self._view) - self._pos))
        dst[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


class _BufferPool:
    """Reusable read buffers: a fresh multi-MB allocation costs more in page faults than reading into it.

    Holds at most as many buffers as items are in flight (plus one); items below ``min_bytes`` use plain bytes.
    """

    def __init__(self, min_bytes: int = 1 << 20) -> None:
        self.min_bytes = min_bytes
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> Optional[bytearray]:
        if n < self.min_bytes:
            return None
        with self._lock:
            fits = [b for b in self._free if len(b) >= n]
            if fits:
                buf = min(fits, key=len)
                self._free.remove(buf)
                return buf
            if self._free:  # none is large enough: drop the largest, so the pool does not grow
                self._free.remove(max(self._free, key=len))
        return bytearray(n)

    def give(self, buf: Optional[bytearray]) -> None:
        if buf is not None:
            with self._lock:
                self._free.append(buf)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader that checks every file against the completion marker and every item as it reads it.

    Args:
        path: the checkpoint directory.
        marker: its :class:`~megashard.checkpoint.safety.Marker` (default: read it).
        verified: relative paths already checked (e.g. by other ranks); others are checked on first use.
        checksum: verify checksums (True) or compare sizes only (False).
        io_threads: threads reading and hashing items ahead of the one being deserialised.
        readahead_bytes: at most this many bytes read ahead (at least one item).
    """

    def __init__(self, path: str, marker: Optional[safety.Marker] = None, *,
                 verified: Optional[Iterable[str]] = None, checksum: bool = True,
                 io_threads: int = 1, readahead_items: int = 1, readahead_bytes: int = 256 << 20) -> None:
        super().__init__(path)
        self.ckpt_dir = str(path)
        self.marker = marker if marker is not None else safety.read_marker(self.ckpt_dir)
        self.verified = set(verified or ())
        self.checksum = checksum
        self.io_threads = max(1, int(io_threads))
        self.readahead_items = max(0, int(readahead_items))
        self.readahead_bytes = int(readahead_bytes)
        self._metadata: Optional[Metadata] = None

    def _ensure_verified(self, names: Sequence[str]) -> None:
        """Whole-file check of ``names`` on first use: size, and checksum unless the file has per-item checksums."""
        todo = [n for n in names if n not in self.verified]
        if todo:
            problems = safety.verify_files(self.ckpt_dir, self.marker, todo, checksum=self.checksum, defer_items=True)
            safety.raise_problems(self.ckpt_dir, problems)
            self.verified.update(todo)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata: megashard never writes it
            raise CheckpointCorruptedError(f"{os.path.join(self.ckpt_dir, DCP_METADATA)}: DCP metadata file is missing")
        if self._metadata is not None:  # unpickled once per reader (offline tools load in several passes)
            return self._metadata
        self._ensure_verified([DCP_METADATA])
        md = load_dcp_metadata(os.path.join(self.ckpt_dir, DCP_METADATA))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        try:
            md.storage_meta.load_id = self.load_id
        except AttributeError:  # pragma: no cover - older StorageMeta
            pass
        self._metadata = md
        return md

    def _itemized(self, name: str, reqs: list) -> bool:
        table = self.marker.items.get(name)
        if not (self.checksum and table):
            return False
        for req in reqs:
            info = self.storage_data[req.storage_index]
            if (int(info.offset), int(info.length)) not in table or getattr(info, "transform_descriptors", None):
                return False
        return True

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        rest = []
        for name in sorted(per_file):
            self._ensure_verified([name])
            if self._itemized(name, per_file[name]):
                self._read_items(name, per_file[name], planner)
            else:  # no per-item checksums (older checkpoint): the whole file was hashed above
                rest += per_file[name]
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _fetch(self, name: str, index: Any, offset: int, length: int, pool: _BufferPool) -> tuple[Any, memoryview]:
        """Read and verify one storage item (runs in a pool thread): ``(buffer to give back, its bytes)``."""
        path = os.path.join(self.ckpt_dir, name)
        buf = pool.take(length)
        view = memoryview(buf if buf is not None else bytearray(length))[:length]
        got = 0
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                while got < length:
                    n = f.readinto(view[got:])  # one read returns at most ~2 GB
                    if not n:
                        break
                    got += n
            what = f"item {index.fqn!r}" + (f" (chunk at {list(index.offset)})" if getattr(index, "offset", None) else "")
            if got != length:
                safety.raise_problems(self.ckpt_dir, [f"{path}: truncated: {what} ends at byte {offset + length}, the "
                                                      f"file ends at {offset + got}"])
            expected = self.marker.items[name][(offset, length)]
            actual = checksums.bytes_checksum(view, self.marker.algorithm)
            if actual != expected:
                safety.raise_problems(self.ckpt_dir, [safety.item_problem(
                    path, what, offset, length, self.marker.algorithm, actual, expected)])
        except BaseException:
            pool.give(buf)
            raise
        return buf, view

    def _read_items(self, name: str, reqs: list, planner) -> None:
        groups: dict[Any, list] = {}
        for req in reqs:
            groups.setdefault(req.storage_index, []).append(req)
        tasks = sorted(groups.items(), key=lambda kv: int(self.storage_data[kv[0]].offset))
        pending: collections.deque = collections.deque()
        nxt, inflight = 0, 0
        buffers = _BufferPool()
        pool = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="megashard-ckpt-read")
        try:
            while nxt < len(tasks) or pending:
                while nxt < len(tasks) and (not pending or (len(pending) <= self.readahead_items
                                                             and inflight < self.readahead_bytes)):
                    index = tasks[nxt][0]
                    info = self.storage_data[index]
                    size = int(info.length)
                    pending.append((nxt, size, pool.submit(self._fetch, name, index, int(info.offset), size, buffers)))
                    inflight += size
                    nxt += 1
                i, size, fut = pending.popleft()
                buf, view = fut.result()
                inflight -= size
                try:
                    self._deliver(view, tasks[i][1], planner)
                finally:
                    buffers.give(buf)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _deliver(data: memoryview, reqs: list, planner) -> None:
        """Hand one verified item to the planner, as DCP's reader does (``torch.load`` copies out of ``data``)."""
        tensor = None
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data.tobytes()))
                continue
            if tensor is None:
                tensor = torch.load(_MemoryReader(data), map_location="cpu", weights_only=True)
            part = dcp_narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise CheckpointCorruptedError(
                    f"item {req.storage_index.fqn!r}: saved chunk has size {tuple(part.size())}, the load plan expects "
                    f"{tuple(target.size())}")
            target.copy_(part)
            planner.commit_tensor(req, target)
