"""No leaked groups (Megatron-LM issue #6897: ``destroy_model_parallel`` leaks ~20 NCCL groups per cycle).

Six ``initialize_model_parallel`` / ``destroy_model_parallel`` cycles with changing layouts on 8 gloo ranks: after
each, the live process groups (torch's group map) and this process's open file descriptors (gloo's sockets among
them) are back to what they were before the first cycle, and a collective on every group of the cycle adds up
exactly its members (so the groups were real, connected communicators).
"""
from __future__ import annotations

import os

import pytest

from tests._dist import spawn_checks

LAYOUTS = [
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    dict(tensor_model_parallel_size=4),
    dict(pipeline_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2),
    dict(tensor_model_parallel_size=2, gtp_remat_size=2),
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_distributed_optimizer_instances=2),
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),  # the first again: fresh groups, no clash
]


def _fds() -> int:
    """Open fds, settled: the fewest over a few samples (the test harness's result queue opens a pipe now and then;
    a leaked socket stays)."""
    import time

    counts = []
    for _ in range(6):
        counts.append(len(os.listdir("/proc/self/fd")))
        time.sleep(0.05)
    return min(counts)


def check_six_cycles_leave_nothing(rank, world_size):
    import torch
    import torch.distributed as dist

    import megashard.parallel_state as ps
    from megashard._compat import live_process_group_count

    start = (live_process_group_count(), _fds())
    seen = []
    for kw in LAYOUTS:
        ps.initialize_model_parallel(distributed_timeout_minutes=1, **kw)
        st = ps._st()
        during = live_process_group_count()
        assert during > start[0] + 1, (kw, during)  # it did create groups
        for name in ("tp", "pp", "dp", "dp_cp", "mp", "ep", "expt_dp", "gtp_remat"):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=st.group(name))
            assert t.item() == sum(st.ranks(name)), (kw, name)
        pgs = st.pg_collection(megatron=False)  # gloo groups through the collection (none under gtp_remat)
        gtp = kw.get("gtp_remat_size", 1) > 1
        assert pgs.dp_gloo is (None if gtp else st.group("dp")), kw
        assert pgs.intra_expt_dp_gloo is (None if gtp else st.group("intra_expt_dp")), kw
        del pgs  # the collection holds the groups: a caller that keeps it keeps them
        ps.destroy_model_parallel()
        now = (live_process_group_count(), _fds())
        seen.append((during, now))
        assert now == start, f"after {kw}: live groups, fds {now} != {start} at the start (cycle log {seen})"


@pytest.fixture(scope="module")
def world8():
    return spawn_checks([check_six_cycles_leave_nothing], world_size=8, timeout=400)


def test_six_init_destroy_cycles_leak_no_group_or_fd(world8):
    world8.assert_ok("check_six_cycles_leave_nothing")
