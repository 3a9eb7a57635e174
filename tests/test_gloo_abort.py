"""Aborting gloo groups for real (megashard._compat.gloo_abort; live recovery, issue 36): ``ProcessGroup.abort`` does
nothing on gloo, so a survivor blocked in a collective that waits for another survivor (alive, but gone to the next
world) used to wait ``parallel.timeout``. Shutting down the connections the world's gloo listeners accepted fails it
at once, on both ends; the groups made before the snapshot keep working.

Real gloo groups in 2 spawned processes. A shutdown that did not work would leave rank 0 in its all-reduce until the
group's timeout, and the check would fail on its "timed out" error instead of the closed connection.
"""
from __future__ import annotations

import threading
import time

import pytest

from tests._dist import spawn_checks

GROUP_TIMEOUT = 120.0  # a working shutdown ends the all-reduce long before; a broken one ends on this timeout


def check_a_shutdown_wakes_a_collective_waiting_for_a_live_peer(rank, world_size):
    import torch
    import torch.distributed as dist

    from megashard._compat.gloo_abort import listening_now, shut_down_gloo_connections

    before = listening_now()  # the default group already listens: it must be spared
    world = dist.new_group([0, 1])  # "the world" whose connections are shut down
    dist.barrier(group=world)
    shut: list = []
    if rank == 0:  # blocked in a collective rank 1 never enters; its own thread shuts down its side meanwhile
        t = threading.Thread(target=lambda: (time.sleep(0.5), shut.append(shut_down_gloo_connections(before))))
        t.start()
        try:
            dist.all_reduce(torch.ones(4), group=world)
            raise AssertionError("rank 0: the all-reduce returned although rank 1 never entered it")
        except RuntimeError as e:
            text = str(e).lower()
            assert "timed out" not in text and "timeout" not in text, f"rank 0 waited the group's timeout: {e}"
        t.join()
    else:
        time.sleep(0.5)
        shut.append(shut_down_gloo_connections(before))
    counts: list = [None] * world_size
    dist.all_gather_object(counts, shut[0])  # on the default group: spared by the shutdown
    assert sum(counts) == 1, f"rank {rank}: one connection (the pair of 0 and 1) is accepted by one side: {counts}"
    with pytest.raises(RuntimeError):  # the shut-down group stays broken
        dist.all_reduce(torch.ones(1), group=world)


def check_nothing_listened_since_shuts_nothing_down(rank, world_size):
    import torch
    import torch.distributed as dist

    from megashard._compat.gloo_abort import listening_now, shut_down_gloo_connections

    assert shut_down_gloo_connections(listening_now()) == 0, f"rank {rank}"
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0], f"rank {rank}: {t.tolist()}"


@pytest.fixture(scope="module")
def gloo2():
    return spawn_checks([check_nothing_listened_since_shuts_nothing_down,
                         check_a_shutdown_wakes_a_collective_waiting_for_a_live_peer],
                        world_size=2, pg_timeout=GROUP_TIMEOUT, timeout=600)


def test_a_shutdown_of_the_worlds_gloo_connections_wakes_a_collective_waiting_for_a_live_peer(gloo2):
    gloo2.assert_ok("check_a_shutdown_wakes_a_collective_waiting_for_a_live_peer")


def test_connections_older_than_the_snapshot_are_spared(gloo2):
    gloo2.assert_ok("check_nothing_listened_since_shuts_nothing_down")
