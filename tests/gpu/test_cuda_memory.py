"""The memory buffer on CUDA: its first allocation lands in the memory pool of ``mem_alloc_context``, and requests
that fit reuse it without one new allocation (counted by the caching allocator), unlike ``torch.empty``."""
from __future__ import annotations

import pytest
import torch

from megashard.state.memory import GlobalMemoryBuffer

pytestmark = pytest.mark.gpu

SHAPE = (1024, 1024)
REQUESTS = 100


def _allocations() -> int:
    """Cumulative number of allocations the CUDA caching allocator served on the current device."""
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def _in_pool(pool: torch.cuda.MemPool, t: torch.Tensor) -> bool:
    """Whether ``t``'s storage lies in a segment of ``pool`` (segments carry their pool's id, as inductor reads them)."""
    ptr = t.untyped_storage().data_ptr()
    return any(tuple(seg["segment_pool_id"]) == tuple(pool.id) and seg["address"] <= ptr < seg["address"] + seg["total_size"]
               for seg in torch.cuda.memory_snapshot())


def test_buffer_on_cuda_reuses_its_pool_allocation():
    torch.cuda.set_device(0)
    buf = GlobalMemoryBuffer()
    assert buf.device == torch.device("cuda", 0), buf.device
    pool = torch.cuda.MemPool()
    ctx = lambda: torch.cuda.use_mem_pool(pool)  # noqa: E731 - the callable get_tensor expects

    before = _allocations()
    first = buf.get_tensor(SHAPE, torch.bfloat16, "mpu", mem_alloc_context=ctx)
    assert _allocations() - before == 1, "the first request should allocate exactly once"
    assert first.device.type == "cuda" and _in_pool(pool, first), "the buffer was not allocated in the memory pool"

    before = _allocations()
    views = [buf.get_tensor(SHAPE if i % 2 else (512, 2048), torch.bfloat16, "mpu", mem_alloc_context=ctx)
             for i in range(REQUESTS)]
    assert _allocations() - before == 0, f"{_allocations() - before} new allocations for {REQUESTS} requests that fit"
    assert all(v.data_ptr() == first.data_ptr() for v in views), "a request that fits got other memory"

    before = _allocations()
    for _ in range(REQUESTS):
        torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda")
    assert _allocations() - before == REQUESTS, "baseline: torch.empty allocates per call"

    before = _allocations()
    bigger = buf.get_tensor((2048, 1024), torch.bfloat16, "mpu", mem_alloc_context=ctx)
    assert _allocations() - before == 1 and _in_pool(pool, bigger), "growing allocates once, in the pool"
    other = buf.get_tensor(SHAPE, torch.float32, "mpu")  # another dtype: its own buffer, no context: not in the pool
    assert not _in_pool(pool, other) and other.data_ptr() != bigger.data_ptr()
    assert buf.nbytes() == 2048 * 1024 * 2 + 1024 * 1024 * 4
