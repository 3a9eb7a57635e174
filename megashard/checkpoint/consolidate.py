"""Offline checkpoint tools: inspect a checkpoint, consolidate it into one ``torch.save`` file.

Both run in one process without torch.distributed (DCP's ``no_dist`` loading, as
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does), so they work on a laptop for
any checkpoint megashard saved, whatever its layout::

    from megashard.checkpoint.consolidate import inspect_checkpoint, consolidate
    info = inspect_checkpoint("ckpts")            # newest complete checkpoint under the root
    print(format_info(info))
    consolidate("ckpts/step_00000100", "full.pt") # then torch.load("full.pt", weights_only=True)

The consolidated file holds ``{"model": {fqn: tensor}, "optim": {"state": ..., "param_groups": ...}}``
(the sections that were saved) with full, unsharded tensors: ``model`` loads into a plain module with
``load_state_dict``; ``optim`` is keyed by parameter names, as DCP's ``get_state_dict`` returns it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megashard._compat import dcp_load_state_dict
from megashard.checkpoint import safety
from megashard.checkpoint.collective import unwrap_dcp_error
from megashard.checkpoint.planners import empty_state_dict_load_planner
from megashard.checkpoint.storage import DCP_METADATA, SafeFileSystemReader, load_dcp_metadata
from megashard.errors import CheckpointError
from megashard.progress import Progress

__all__ = [
    "CheckpointInfo",
    "TensorInfo",
    "consolidate",
    "format_info",
    "info_to_dict",
    "inspect_checkpoint",
    "load_full_state_dict",
]


# ---------------------------------------------------------------------------------------------- inspect
@dataclass
class TensorInfo:
    """One saved tensor: global shape, dtype, bytes, number of saved chunks and the ranks that wrote them."""

    key: str
    shape: tuple
    dtype: str
    nbytes: int
    chunks: int
    writers: list


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` reports about one checkpoint (and its siblings under the root)."""

    path: str
    step: int
    algorithm: str
    files: int
    file_bytes: int
    layout: dict
    consumed_samples: Optional[int]
    has_data_state: bool
    torch_version: str
    tensors: list = field(default_factory=list)
    objects: list = field(default_factory=list)  # keys of non-tensor items
    siblings: list = field(default_factory=list)  # (name, state) of the other entries of the root
    problems: list = field(default_factory=list)  # verification problems (when verified)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


#: ``ckpt inspect`` shows keys in these groups, in this order, by their first dotted part (the rest: ``extra``).
KEY_GROUPS = (("model", ("model",)), ("optimizer", ("optim",)))


def key_group(key: str) -> str:
    """``"model"``, ``"optimizer"`` or ``"extra"`` (anything else: rng, data state, user sections) for a saved key."""
    head = key.split(".", 1)[0]
    return next((name for name, prefixes in KEY_GROUPS if head in prefixes), "extra")


def key_order(key: str) -> tuple:
    """Sort key of a saved key: its group (model, optimizer, extra), then by name with numbers in numeric order
    (``blocks.2`` before ``blocks.10``)."""
    import re

    order = [name for name, _ in KEY_GROUPS] + ["extra"]
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", key) if p)
    return (order.index(key_group(key)), parts)


def _writer_rank(relative_path: str) -> Optional[int]:
    """Rank in a DCP data file name ``__<rank>_<n>.distcp``."""
    parts = relative_path.split("_")
    if len(parts) >= 4 and relative_path.startswith("__") and parts[2].isdigit():
        return int(parts[2])
    return None


def _siblings(root: str, ckpt: str) -> list:
    out = []
    for e in safety.list_checkpoints(root):
        if os.path.abspath(e.path) != os.path.abspath(ckpt):
            out.append((os.path.basename(e.path), "complete" if e.complete else "incomplete (no marker)"))
    if os.path.isdir(root):
        for n in sorted(os.listdir(root)):
            if n.startswith(safety.TMP_PREFIX):
                out.append((n, "unfinished save (ignored)"))
    return out


def inspect_checkpoint(path: str, *, verify: bool = True, progress: bool = False) -> CheckpointInfo:
    """Describe a checkpoint (``path`` or the newest complete one under it) without loading tensors.

    ``verify=True`` (default) recomputes every file's checksum (whole files, as recorded in the marker);
    problems with data files are listed in ``info.problems`` rather than raised. Sizes are always compared
    with the marker. A damaged, truncated or missing ``.metadata`` / ``megashard.json`` (nothing else can
    be described then) or completion marker raises :class:`~megashard.errors.CheckpointCorruptedError`.
    """
    ckpt = os.path.abspath(safety.resolve_checkpoint(path))
    marker = safety.read_marker(ckpt)
    problems = safety.verify_files(ckpt, marker, checksum=False)
    if verify and not problems:
        bar = Progress(marker.total_bytes, "verify", enabled=progress)
        problems = safety.verify_files(ckpt, marker, checksum=True, progress=bar.update)
        bar.close()
    meta_problem = [p for p in problems if p.startswith(os.path.join(ckpt, safety.LAYOUT_FILE))
                    or p.startswith(os.path.join(ckpt, DCP_METADATA))]
    if meta_problem:
        safety.raise_problems(ckpt, meta_problem)  # nothing below can be trusted
    info = safety.read_json(os.path.join(ckpt, safety.LAYOUT_FILE), "layout file")
    md = load_dcp_metadata(os.path.join(ckpt, DCP_METADATA))
    writers: dict = {}
    for idx, sinfo in (md.storage_data or {}).items():
        r = _writer_rank(getattr(sinfo, "relative_path", ""))
        writers.setdefault(idx.fqn, set()).add(r)
    tensors, objects = [], []
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            numel = 1
            for s in m.size:
                numel *= int(s)
            tensors.append(TensorInfo(key, tuple(int(s) for s in m.size), str(m.properties.dtype).replace("torch.", ""),
                                      numel * m.properties.dtype.itemsize, len(m.chunks),
                                      sorted(r for r in writers.get(key, ()) if r is not None)))
        elif isinstance(m, BytesStorageMetadata):
            objects.append(key)
    tensors.sort(key=lambda t: key_order(t.key))  # DCP lists them in the order ranks wrote them
    objects.sort(key=key_order)
    root = os.path.dirname(ckpt)
    return CheckpointInfo(
        path=ckpt, step=marker.step, algorithm=marker.algorithm, files=len(marker.files), file_bytes=marker.total_bytes,
        layout=info.get("layout", {}), consumed_samples=info.get("consumed_samples"),
        has_data_state=bool(info.get("has_data_state")), torch_version=str(info.get("torch", "?")),
        tensors=tensors, objects=objects, siblings=_siblings(root, ckpt), problems=problems,
    )


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_layout(layout: dict) -> str:
    s = layout.get("sizes")
    if not s:
        return f"{layout.get('world_size', '?')} ranks (no megashard layout recorded: plain data parallel)"
    return (f"{s['world_size']} ranks: tp={s['tp']} cp={s['cp']} pp={s['pp']} dp={s['dp']} (dp_outer={s['dp_outer']} x "
            f"dp_shard={s['dp_shard']}) ep={s['ep']} expt_tp={s['expt_tp']} expt_dp={s['expt_dp']} order={s['order']}")


def _fmt_ranks(ranks: list) -> str:
    text = ",".join(str(r) for r in ranks[:8])
    return text + (f",... ({len(ranks)})" if len(ranks) > 8 else "")


def format_info(info: CheckpointInfo) -> str:
    """A human-readable table of :func:`inspect_checkpoint`'s result."""
    lines = [
        f"checkpoint  {info.path}",
        f"step        {info.step}   ({info.files} files, {_fmt_bytes(info.file_bytes)}, {info.algorithm} checksums)",
        f"saved with  {_fmt_layout(info.layout)}",
        f"data        consumed_samples={info.consumed_samples}  per-rank data-loader state: "
        f"{'saved' if info.has_data_state else 'none'}   (torch {info.torch_version})",
    ]
    if info.problems:
        lines.append(f"PROBLEMS    {len(info.problems)} damaged file(s):")
        lines += [f"  {p}" for p in info.problems]
    kw = max([len("key")] + [len(t.key) for t in info.tensors])
    sw = max([len("shape")] + [len(str(t.shape)) for t in info.tensors])
    for group in [name for name, _ in KEY_GROUPS] + ["extra"]:  # tensors are sorted by key_order already
        tensors = [t for t in info.tensors if key_group(t.key) == group]
        objects = [k for k in info.objects if key_group(k) == group]
        if not tensors and not objects:
            continue
        lines.append("")
        lines.append(f"{group}: {len(tensors)} tensors, {_fmt_bytes(sum(t.nbytes for t in tensors))}"
                     + (f"; non-tensor items: {', '.join(objects)}" if objects else ""))
        if tensors:
            lines.append(f"  {'key':<{kw}}  {'shape':<{sw}}  {'dtype':<9}  {'size':>10}  chunks  written by rank")
        for t in tensors:
            lines.append(f"  {t.key:<{kw}}  {str(t.shape):<{sw}}  {t.dtype:<9}  {_fmt_bytes(t.nbytes):>10}  "
                         f"{t.chunks:>6}  {_fmt_ranks(t.writers)}")
    lines.append("")
    lines.append(f"{len(info.tensors)} tensors, {_fmt_bytes(info.tensor_bytes)}; {len(info.objects)} non-tensor items")
    if info.siblings:
        lines.append("")
        lines.append("other entries in " + os.path.dirname(info.path) + ":")
        lines += [f"  {n}: {s}" for n, s in info.siblings]
    return "\n".join(lines) + "\n"


def info_to_dict(info: CheckpointInfo) -> dict:
    """JSON-ready form of a :class:`CheckpointInfo`."""
    return {
        "path": info.path, "step": info.step, "algorithm": info.algorithm, "files": info.files,
        "file_bytes": info.file_bytes, "layout": info.layout, "consumed_samples": info.consumed_samples,
        "has_data_state": info.has_data_state, "torch": info.torch_version,
        "tensors": [{"key": t.key, "group": key_group(t.key), "shape": list(t.shape), "dtype": t.dtype,
                     "bytes": t.nbytes, "chunks": t.chunks, "writers": t.writers} for t in info.tensors],
        "objects": info.objects, "siblings": [{"name": n, "state": s} for n, s in info.siblings],
        "problems": info.problems,
    }


# ---------------------------------------------------------------------------------------------- consolidate
def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            for i, x in enumerate(v):  # DCP fills lists position by position; keep what is already there
                if i < len(dst[k]) and isinstance(x, dict) and isinstance(dst[k][i], dict):
                    _merge(dst[k][i], x)
                elif i >= len(dst[k]):
                    dst[k].append(x)
                elif x is not None:
                    dst[k][i] = x
        else:
            dst[k] = v


def load_full_state_dict(
    path: str,
    *,
    keys: Optional[set] = None,
    verify: bool = True,
    progress: bool = False,
    batch_bytes: int = 256 << 20,
) -> dict:
    """Every tensor of a checkpoint, unsharded, in one process (nested as it was saved).

    Args:
        path: a checkpoint directory or a root (its newest complete checkpoint).
        keys: flattened keys (e.g. ``"model.up.weight"``) or prefixes of them to load (default: all).
        verify: verify what is read against the checksums in the marker (per DCP storage item, as it is read;
            whole files first for checkpoints without item checksums). Sizes are always checked.
        progress: show progress bars on stderr.
        batch_bytes: tensors are read in batches of about this many bytes (one progress step each).
    """
    ckpt = os.path.abspath(safety.resolve_checkpoint(path))
    marker = safety.read_marker(ckpt)
    # Files with per-item checksums: sizes now, every item verified as it is read below. Others: hashed now.
    hashed = [n for n in sorted(marker.files) if n not in marker.items]
    bar = Progress(sum(marker.files[n]["size"] for n in hashed), "verify     ", enabled=progress and verify)
    problems = safety.verify_files(ckpt, marker, hashed, checksum=verify, progress=bar.update)
    bar.close()
    safety.raise_problems(ckpt, problems + safety.verify_files(ckpt, marker, sorted(marker.items), checksum=False))
    reader = SafeFileSystemReader(ckpt, marker, verified=marker.files, checksum=verify)
    md = reader.read_metadata()

    def wanted(k: str) -> bool:
        return keys is None or any(k == p or k.startswith(p + ".") for p in keys)

    items = [(k, m) for k, m in md.state_dict_metadata.items() if wanted(k)]
    if keys is not None and not items:
        raise CheckpointError(f"none of the keys {sorted(keys)[:5]} is in {ckpt}; it holds e.g. {list(md.state_dict_metadata)[:5]}")
    batches: list[tuple[set, int]] = []
    cur: set = set()
    size = 0
    for k, m in items:
        nb = 0
        if isinstance(m, TensorStorageMetadata):
            nb = m.properties.dtype.itemsize
            for s in m.size:
                nb *= int(s)
        if cur and size + nb > batch_bytes:
            batches.append((cur, size))
            cur, size = set(), 0
        cur.add(k)
        size += nb
    if cur:
        batches.append((cur, size))
    total = sum(s for _, s in batches)
    bar = Progress(total, "consolidate", enabled=progress)
    out: dict = {}
    for batch, nb in batches:
        part: dict = {}
        try:
            dcp_load_state_dict(part, reader, empty_state_dict_load_planner(batch), no_dist=True)
        except CheckpointException as e:
            raise unwrap_dcp_error(e) from None
        _merge(out, part)
        bar.update(nb)
    bar.close()
    return out


#: How a file ``consolidate`` wrote begins its zip comment (torch.load ignores the comment).
CONSOLIDATED = b"megashard ckpt consolidate"


def consolidate(path: str, out: str, *, verify: bool = True, progress: bool = False, keys: Optional[set] = None,
                overwrite: bool = False) -> dict:
    """Write a checkpoint's full (unsharded) state into one ``torch.save`` file ``out``.

    The file loads with ``torch.load(out, weights_only=True)``; it is written to ``out + ".tmp"`` first
    and renamed, so ``out`` is never half-written (missing parent directories are created). Returns a summary
    ``{"path", "out", "tensors", "bytes"}``. ``out`` is checked before anything is read
    (:func:`megashard.outputs.check_output_file`): ConfigError for a directory, a path under a file, an unwritable
    place or a path inside the checkpoint itself. An existing ``out`` is replaced when an earlier consolidate wrote it
    (its zip comment says so), or with ``overwrite`` when it is another ``torch.save`` file; anything else never:
    megashard never overwrites a file of the user's.
    """
    from megashard.outputs import check_output_file, is_torch_archive, temp_path, torch_archive_comment

    def mine(p: str) -> Optional[str]:
        if not is_torch_archive(p):
            return "exists and is not a torch.save file (as consolidate writes)"
        if overwrite or torch_archive_comment(p).startswith(CONSOLIDATED):
            return None  # --force, or an earlier consolidate's own output (it says so in its zip comment)
        return "exists and is a torch.save file megashard did not write; pass --force to replace it"

    ckpt = safety.resolve_checkpoint(path)
    check_output_file("OUT", out, reads=[ckpt, path], create_parents=True, example="full.pt", mine=mine)
    state = load_full_state_dict(ckpt, keys=keys, verify=verify, progress=progress)
    count, nbytes = 0, 0

    def walk(x: Any) -> None:
        nonlocal count, nbytes
        if isinstance(x, torch.Tensor):
            count += 1
            nbytes += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = temp_path(out)  # a new name of its own next to OUT, renamed when complete
    try:
        torch.save(state, tmp)
        import zipfile

        with zipfile.ZipFile(tmp, "a") as z:  # the mark of megashard's own output: a rerun may replace it
            z.comment = CONSOLIDATED + f" of {os.path.abspath(ckpt)}".encode("utf-8", "replace")[:60000]
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"path": os.path.abspath(ckpt), "out": out, "tensors": count, "bytes": nbytes}
