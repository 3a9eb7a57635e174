"""Ranks that disagree get an error, not a hang; and a cp=2 step without torch's deprecation warnings.

One spawn of 2 gloo ranks:

* equal configs pass (ParallelState, megashard.initialize with extra fields, the job's fingerprint);
* a different parallel config, different extra fields, a different job YAML: both ranks raise
  RankMismatchError naming the ranks and the differing fields (the exchanged values: not the timeout's error);
* a cp=2 training step and the all-gather helper run with torch's all_gather_into_tensor /
  reduce_scatter_tensor FutureWarnings turned into errors, and gather exact values;
* last: a rank that joins the check only after the other gave up makes the other one fail after its own timeout,
  not hang (and the late one then fails with the peer's error, not a timeout of its own). Nothing is timed: the
  late rank waits for the other's word (a file), not for a number of seconds.
"""
from __future__ import annotations

import math
import os
import re
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn_checks

TIMEOUT = 20.0
ENV = "MEGASHARD_AGREE_TEST_DIR"


def _mismatch(fn):
    from megashard.errors import RankMismatchError

    with pytest.raises(RankMismatchError) as e:
        fn()
    msg = str(e.value)
    # the values were exchanged and compared: a rank that only waited would name no field, but the timeout
    assert "differs from rank" in msg and "did not" not in msg and "within" not in msg, msg
    return msg


def check_equal_configs_pass(rank, world_size):
    import megashard.state as ms
    from megashard.config import ParallelConfig

    st = ms.ParallelState(ParallelConfig(tp=2, timeout=TIMEOUT))
    assert st.size("tp") == 2 and st.ranks("tp") == [0, 1]
    st = ms.initialize(ParallelConfig(dp_shard=2, timeout=TIMEOUT), agree_on={"train.steps": 10, "model.hidden": 64})
    try:
        assert st.size("dp_shard") == 2
    finally:
        ms.destroy()


def check_different_parallel_configs_raise_on_both_ranks(rank, world_size):
    import megashard.state as ms
    from megashard.config import ParallelConfig

    msg = _mismatch(lambda: ms.ParallelState(ParallelConfig(tp=1 + rank, seed=7, timeout=TIMEOUT)))
    assert "rank 1 differs from rank 0 in parallel.tp (2 vs 1)" in msg, msg
    assert "parallel.dp_shard" not in msg and "parallel.seed" not in msg and "\n" not in msg, msg
    # Derived sizes (dp_shard -1 vs 1) that resolve to the same layout still differ as written.
    msg = _mismatch(lambda: ms.ParallelState(ParallelConfig(tp=2, dp_shard=-1 if rank else 1, timeout=TIMEOUT)))
    assert "parallel.dp_shard (-1 vs 1)" in msg, msg
    assert not ms.is_initialized()


def check_different_extra_fields_raise_on_both_ranks(rank, world_size):
    import megashard.state as ms
    from megashard.config import ParallelConfig

    extra = {"train.steps": 10 * (1 + rank), "model.hidden": 64, "data.path": "a.txt" if rank == 0 else None}
    msg = _mismatch(lambda: ms.initialize(ParallelConfig(timeout=TIMEOUT), agree_on=extra))
    assert "rank 1 differs from rank 0 in" in msg and "train.steps (20 vs 10)" in msg, msg
    assert "data.path (null vs a.txt)" in msg and "model.hidden" not in msg, msg
    assert not ms.is_initialized()


def check_job_configs_are_compared_whole(rank, world_size):
    import megashard.state as ms
    from megashard.train.config import JobConfig
    from megashard.train.loop import job_fingerprint

    doc = {"parallel": {"dp_shard": 2, "timeout": TIMEOUT}, "launch": {"nproc_per_node": 2, "node_rank": rank}}
    same = JobConfig.from_dict(doc, name="default")
    ms.initialize(same.parallel, agree_on=job_fingerprint(same))  # node_rank differs by design: not compared
    ms.destroy()
    other = JobConfig.from_dict({**doc, "train": {"steps": 200 + rank}, "optim": {"lr": 0.01 if rank else 0.003}},
                                name="default")
    msg = _mismatch(lambda: ms.initialize(other.parallel, agree_on=job_fingerprint(other)))
    assert "rank 1 differs from rank 0 in optim.lr (0.01 vs 0.003), train.steps (201 vs 200)" in msg, msg


def check_cp2_step_without_deprecated_collectives(rank, world_size):
    import megashard.state as ms
    from megashard.config import ParallelConfig
    from megashard.train.config import JobConfig
    from megashard.models.layers import _all_gather, gather_seq
    from megashard.train.loop import train

    with warnings.catch_warnings():
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            warnings.filterwarnings("error", message=f".*{name}", category=FutureWarning)
        out = torch.empty(4, dtype=torch.int64)
        _all_gather(out, torch.tensor([rank, 10 + rank]), dist.group.WORLD)
        assert out.tolist() == [0, 10, 1, 11]
        st = ms.initialize(ParallelConfig(cp=2, timeout=TIMEOUT))
        try:  # forward gathers the sequence, backward reduce-scatters the gradient
            x = torch.full((1, 2, 3), float(rank + 1), requires_grad=True)
            y = gather_seq(x, st.group("cp"))
            assert y[0, :, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
            (y * torch.arange(4.0).view(1, 4, 1)).sum().backward()
            assert x.grad[0, :, 0].tolist() == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])  # 2 ranks summed
        finally:
            ms.destroy()
        tmp = os.environ[ENV]  # the same directory on both ranks (the job's fields must agree)
        doc = {"parallel": {"cp": 2, "timeout": TIMEOUT}, "launch": {"nproc_per_node": 2},
               "model": {"seq_len": 16, "hidden": 32, "heads": 2},
               "train": {"steps": 2, "global_batch": 2, "out_dir": os.path.join(tmp, "{name}"), "plot": False,
                         "progress": False},
               "checkpoint": {"interval": 0, "save_final": False}}
        res = train(JobConfig.from_dict(doc, name="cp2"))
        assert sorted(res.losses) == [1, 2] and abs(res.losses[1] - math.log(256)) < 0.1, res.losses  # ~uniform
        if rank == 0:  # rank 0 took the checkpoint directory's lock and released it
            assert os.path.isdir(os.path.join(tmp, "cp2", "checkpoints"))
            assert not os.path.exists(os.path.join(tmp, "cp2", "checkpoints", ".megashard.lock"))


def check_a_rank_that_never_joins_times_out(rank, world_size):
    from megashard.state.agreement import check_ranks_agree
    from megashard.errors import RankMismatchError

    fields = {"x": 1}
    gave_up = os.path.join(os.environ[ENV], "rank0-gave-up")
    if rank == 0:
        with pytest.raises(RankMismatchError, match=r"not every rank joined megashard's config check within 1.5 s"):
            check_ranks_agree(fields, timeout=1.5)  # rank 1 has not joined: it waits for this file
        open(gave_up, "w").close()
    else:
        give_up = time.monotonic() + 240  # a hang guard only
        while not os.path.exists(gave_up):
            assert time.monotonic() < give_up, "rank 0 never gave up"
            time.sleep(0.05)
        # The late rank must not hang. Depending on timing, rank 0's timed-out all_reduce is either still queued
        # in gloo (then it completes with this rank's, and the equal fields agree) or gloo has closed the
        # connection (then this rank fails with that error) - never a wait for the 20 s group timeout (that error
        # would be a timeout's, not PeerLostError's "not a timeout").
        try:
            check_ranks_agree(fields, timeout=TIMEOUT)
        except RuntimeError as e:
            from megashard.errors import PeerLostError

            # What happened, not "not every rank joined ... within 20 s": no 20 s passed.
            assert isinstance(e, PeerLostError), repr(e)
            assert str(e).startswith("rank 1: a peer closed its connection during megashard's config check, "), str(e)
            assert "(not a timeout: parallel.timeout=20 s): another rank exited or crashed" in str(e), str(e)
            assert re.search("(?i)closed|reset", str(e.__cause__)), str(e.__cause__)


CHECKS = [check_equal_configs_pass, check_different_parallel_configs_raise_on_both_ranks,
          check_different_extra_fields_raise_on_both_ranks, check_job_configs_are_compared_whole,
          check_cp2_step_without_deprecated_collectives, check_a_rank_that_never_joins_times_out]


@pytest.fixture(scope="module")
def dist2(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv(ENV, str(tmp_path_factory.mktemp("agree")))  # inherited by the spawned ranks
    return spawn_checks(CHECKS, world_size=2, pg_timeout=TIMEOUT, timeout=240)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_ranks_agree(dist2, check):
    dist2.assert_ok(check)


def test_mismatch_message_groups_ranks_and_limits_fields():
    from megashard.state.agreement import _message

    d1 = {"parallel.tp": (2, 1)}
    many = {f"f{i}": (i, 0) for i in range(9)}
    msg = _message([None, d1, None, d1, many])
    assert msg.startswith("ranks disagree on the job: ranks 1, 3 differ from rank 0 in parallel.tp (2 vs 1); "
                          "rank 4 differs from rank 0 in f0 (0 vs 0), f1 (1 vs 0)"), msg
    assert "and 3 more fields" in msg and "\n" not in msg
