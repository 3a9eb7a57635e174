"""DCP ``.metadata`` is unpickled by an allow-list, also when Enum members are pickled as ``getattr(cls, name)``.

Python 3.11.0-3.11.4 (Debian's 3.11.2 is the system ``python3`` of a fresh machine) reduce an Enum member to
``getattr(EnumClass, name)``; 3.11.5+ to ``EnumClass(value)``. Both must load, on either interpreter: the
pickles here are crafted byte by byte (or with a reducer that does what 3.11.2 does), so the test means the
same everywhere. ``getattr`` on anything but an allow-listed DCP Enum class and one of its members is refused
with CheckpointCorruptedError naming the file.
"""
from __future__ import annotations

import enum
import io
import os
import pickle
import struct

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata

from megashard import checkpoint
from megashard.checkpoint import checksums, safety
from megashard.checkpoint.storage import load_dcp_metadata
from megashard.errors import CheckpointCorruptedError

MD_MODULE = "torch.distributed.checkpoint.metadata"
PLANNER = "torch.distributed.checkpoint.planner"


class _Py3112Pickler(pickle.Pickler):
    """Pickles every Enum member as Python 3.11.0-3.11.4 do: ``(getattr, (EnumClass, name))``."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _dumps_3112(obj, protocol: int) -> bytes:
    buf = io.BytesIO()
    _Py3112Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def _globals_in(data: bytes) -> list[str]:
    """``module name`` of every global a (trusted) pickle references, as the unpickler is asked for them."""
    seen = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append(f"{module} {name}")
            return super().find_class(module, name)

    Recorder(io.BytesIO(data)).load()
    return seen


def _save(tmp_path) -> tuple[str, nn.Module]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(2, 5)).sum().backward()
    opt.step()
    return checkpoint.save(str(tmp_path / "ckpts"), 1, m, opt), m


def _replace_metadata(path: str, data: bytes) -> None:
    """Write ``data`` as ``.metadata`` and record its new checksum (as a tool rewriting the file would)."""
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(data)
    marker = safety.read_marker(path)
    files = dict(marker.files)
    files[".metadata"] = checksums.file_record(os.path.join(path, ".metadata"), marker.algorithm)
    items = {n: [(o, k, c) for (o, k), c in t.items()] for n, t in marker.items.items()}
    safety.write_marker(path, marker.step, files, marker.algorithm, items)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_metadata_pickled_by_python_3_11_2_loads(tmp_path, protocol):
    path, ref = _save(tmp_path)
    md = load_dcp_metadata(os.path.join(path, ".metadata"))
    data = _dumps_3112(md, protocol)
    getattr_globals = [g for g in _globals_in(data) if g.endswith(" getattr")]
    assert getattr_globals and set(getattr_globals) <= {"builtins getattr", "__builtin__ getattr"}
    assert f"{MD_MODULE} _MEM_FORMAT_ENCODING" in _globals_in(data)  # an Enum of the metadata really went this way
    _replace_metadata(path, data)
    again = load_dcp_metadata(os.path.join(path, ".metadata"))
    assert again.state_dict_metadata == md.state_dict_metadata and again.storage_data == md.storage_data
    # The whole checkpoint loads, bit for bit.
    torch.manual_seed(1)
    m2 = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    checkpoint.load(os.path.dirname(path), m2)
    for (k, a), b in zip(ref.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k


# ---------------------------------------------------------------------------------------------- crafted opcodes
def _str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _glob(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL


def _getattr_pickle(owner: bytes, attr: str, module: str = "builtins") -> bytes:
    """Protocol-4 bytes of ``getattr(<owner>, attr)``; ``owner`` is the opcodes pushing the first argument."""
    body = _glob(module, "getattr") + owner + _str(attr) + b"\x86" + b"R"  # TUPLE2, REDUCE
    return b"\x80\x04" + body + b"."


def _getattr_pickle_proto2(owner_module: str, owner_name: str, attr: str) -> bytes:
    """Protocol-2 bytes as Python 3.11.2 writes them: ``c__builtin__\\ngetattr\\n`` ..."""
    a = attr.encode()
    return (b"\x80\x02c__builtin__\ngetattr\n" + f"c{owner_module}\n{owner_name}\n".encode()
            + b"X" + struct.pack("<I", len(a)) + a + b"\x86R.")


def _load_bytes(tmp_path, data: bytes):
    p = tmp_path / "m.pkl"
    p.write_bytes(data)
    return load_dcp_metadata(str(p))


def test_crafted_getattr_of_an_allow_listed_enum_member_resolves(tmp_path):
    from torch.distributed.checkpoint.planner import WriteItemType

    # A bare Enum member is not Metadata: the error proves getattr resolved to the member and nothing ran.
    for data in (_getattr_pickle(_glob(PLANNER, "WriteItemType"), "TENSOR"),
                 _getattr_pickle_proto2(PLANNER, "WriteItemType", "SHARD")):
        with pytest.raises(CheckpointCorruptedError, match="holds a WriteItemType, not DCP Metadata"):
            _load_bytes(tmp_path, data)
    # Inside real metadata (a tuple around it is what DCP's dataclasses hold): the member itself comes back.
    from megashard.checkpoint.storage import _MetadataUnpickler

    assert _MetadataUnpickler(io.BytesIO(_getattr_pickle(_glob(PLANNER, "WriteItemType"), "TENSOR"))).load() \
        is WriteItemType.TENSOR


REFUSED = {
    # allow-listed classes, but not an Enum member: a method, a dunder, Enum machinery
    "method of an allowed class": (_glob(MD_MODULE, "TensorProperties"), "create_from_tensor", "not a member"),
    "dunder of an allowed Enum": (_glob(MD_MODULE, "_MEM_FORMAT_ENCODING"), "__class__", "not a member"),
    "Enum machinery": (_glob(MD_MODULE, "_MEM_FORMAT_ENCODING"), "_missing_", "not a member"),
    "member of an allowed Enum's value": (_glob(MD_MODULE, "_MEM_FORMAT_ENCODING"), "value", "not a member"),
    # not an allow-listed class at all
    "getattr(os, 'system')": (_glob("os", "path"), "system", "os.path' is not a DCP metadata class"),
    "getattr(builtins, 'eval')": (_glob("builtins", "eval"), "__call__", "builtins.eval' is not a DCP metadata class"),
    "a string as owner": (_str("os"), "system", r"getattr\(str, 'system'\)"),
    "getattr of getattr": (_glob("builtins", "getattr"), "__globals__", r"getattr\(function, '__globals__'\)"),
    "a torch class that is no Enum": (_glob("torch", "Size"), "__new__", r"getattr\(Size, '__new__'\)"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_getattr_on_anything_else_is_refused(tmp_path, case):
    owner, attr, why = REFUSED[case]
    with pytest.raises(CheckpointCorruptedError, match=r"m\.pkl: DCP metadata cannot be read safely .*" + why):
        _load_bytes(tmp_path, _getattr_pickle(owner, attr))


def test_refused_globals_and_the_whole_load_path(tmp_path):
    for module, name in (("os", "system"), ("builtins", "eval"), ("__builtin__", "eval"), ("subprocess", "Popen"),
                         ("builtins", "__import__"), ("torch", "load")):
        data = b"\x80\x04" + _glob(module, name) + _str("x") + b"\x85R."  # module.name("x")
        with pytest.raises(CheckpointCorruptedError, match="is not a DCP metadata class"):
            _load_bytes(tmp_path, data)
    # Through checkpoint.load: a .metadata whose Enum lookup is a method is refused, naming the file.
    path, _ = _save(tmp_path)
    _replace_metadata(path, _getattr_pickle(_glob(MD_MODULE, "_MEM_FORMAT_ENCODING"), "_missing_"))
    with pytest.raises(CheckpointCorruptedError, match=r"step_00000001/\.metadata: DCP metadata cannot be read safely"):
        checkpoint.load(os.path.dirname(path), nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)))


def test_metadata_written_by_this_interpreter_still_loads(tmp_path):
    path, _ = _save(tmp_path)
    md = load_dcp_metadata(os.path.join(path, ".metadata"))
    assert isinstance(md, Metadata)
    for protocol in (2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        _replace_metadata(path, pickle.dumps(md, protocol=protocol))
        assert load_dcp_metadata(os.path.join(path, ".metadata")).state_dict_metadata == md.state_dict_metadata
