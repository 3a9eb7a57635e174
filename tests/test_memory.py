"""GlobalMemoryBuffer: reuse without allocation, growth, separate (name, dtype) buffers, teardown."""
from __future__ import annotations

import contextlib

import pytest
import torch

from megashard.errors import ConfigError
from megashard.state.current import current_locals
from megashard.state.memory import GlobalMemoryBuffer, get_global_memory_buffer


@pytest.fixture(autouse=True)
def _clean():
    current_locals().reset()
    yield
    current_locals().reset()


def test_reuse_returns_same_storage_without_allocation():
    buf = GlobalMemoryBuffer()
    a = buf.get_tensor((4, 6), torch.float32, "x")
    assert a.shape == (4, 6) and a.dtype == torch.float32 and a.device.type == "cpu"
    ptr = a.data_ptr()
    b = buf.get_tensor((2, 3, 4), torch.float32, "x")  # same numel: same storage
    c = buf.get_tensor((5,), torch.float32, "x")  # smaller: a prefix view of the same storage
    assert b.data_ptr() == ptr and c.data_ptr() == ptr
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert buf.buffer[("x", torch.float32)].numel() == 24
    c.fill_(7.0)
    assert a.reshape(-1)[:5].eq(7.0).all()  # a view, not a copy
    assert not c.requires_grad and c.is_contiguous()


def test_growth_replaces_buffer_and_keeps_old_views_valid():
    buf = GlobalMemoryBuffer()
    small = buf.get_tensor((3,), torch.float32, "x")
    small.copy_(torch.tensor([1.0, 2.0, 3.0]))
    big = buf.get_tensor((10, 10), torch.float32, "x")
    assert big.shape == (10, 10) and buf.buffer[("x", torch.float32)].numel() == 100
    assert big.data_ptr() != small.data_ptr()
    assert small.tolist() == [1.0, 2.0, 3.0]  # old storage kept alive by the old view
    again = buf.get_tensor((50,), torch.float32, "x")
    assert again.data_ptr() == big.data_ptr()


def test_names_and_dtypes_do_not_collide():
    buf = GlobalMemoryBuffer()
    a = buf.get_tensor((8,), torch.float32, "a")
    b = buf.get_tensor((8,), torch.float32, "b")
    a16 = buf.get_tensor((8,), torch.bfloat16, "a")
    ptrs = {a.data_ptr(), b.data_ptr(), a16.data_ptr()}
    assert len(ptrs) == 3 and a16.dtype == torch.bfloat16
    assert set(buf.buffer) == {("a", torch.float32), ("b", torch.float32), ("a", torch.bfloat16)}
    assert buf.nbytes() == 8 * 4 + 8 * 4 + 8 * 2


def test_mem_alloc_context_used_only_when_allocating():
    entered = []

    @contextlib.contextmanager
    def ctx():
        entered.append(1)
        yield

    buf = GlobalMemoryBuffer()
    buf.get_tensor((4,), torch.float32, "x", mem_alloc_context=ctx)
    buf.get_tensor((2, 2), torch.float32, "x", mem_alloc_context=ctx)
    assert len(entered) == 1
    buf.get_tensor((5,), torch.float32, "x", mem_alloc_context=ctx)
    assert len(entered) == 2


def test_scalar_int_and_empty_shapes():
    buf = GlobalMemoryBuffer()
    assert buf.get_tensor(7, torch.int64, "i").shape == (7,)
    assert buf.get_tensor((), torch.int64, "i").shape == ()
    assert buf.get_tensor((0, 3), torch.int64, "i").shape == (0, 3)
    assert buf.get_tensor(torch.Size([2, 2]), torch.int64, "i").shape == (2, 2)
    t = buf.get_tensor((torch.tensor(2), 3), torch.int64, "i")  # any integer with __index__ (numpy's too)
    assert t.shape == (2, 3) and t.stride() == (3, 1) and t.is_contiguous()


def test_bad_input_is_a_clear_error():
    buf = GlobalMemoryBuffer()
    with pytest.raises(ConfigError, match=r"tensor_shape must be non-negative ints, got \(2, -1\)"):
        buf.get_tensor((2, -1), torch.float32, "x")
    for bad in ((2, True), (2.0, 3), "ab"):
        with pytest.raises(ConfigError, match="tensor_shape must be non-negative ints"):
            buf.get_tensor(bad, torch.float32, "x")
    with pytest.raises(ConfigError, match="dtype must be a torch.dtype"):
        buf.get_tensor((2,), "float32", "x")


def test_global_buffer_is_shared_and_cleared_by_destroy_hook():
    g = get_global_memory_buffer()
    assert get_global_memory_buffer() is g
    g.get_tensor((4,), torch.float32, "x")
    current_locals().reset()
    assert g.buffer == {}
    assert get_global_memory_buffer() is not g


def test_state_destroy_clears_buffer():
    ms = pytest.importorskip("megashard.state")
    g = get_global_memory_buffer()
    ms.destroy()  # not initialised: still tears down the module-level buffer
    assert get_global_memory_buffer() is not g
