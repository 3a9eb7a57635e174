"""How failures of a job are told (megashard.launch.agent, megashard.launch.worker), without launching.

torchrun's final ChildFailedError becomes one line naming the root failures, not the ranks they took
down; peer-loss errors are recognised through their cause chain; an error every rank raises alike is
printed once. (The launches themselves are in test_train_launch.py.)
"""
from __future__ import annotations

import signal

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megashard.errors import CheckpointCorruptedError, ConfigError, RankMismatchError
from megashard.launch.agent import EXIT_PEER_LOST, _summary, describe_exit, is_peer_loss
from megashard.launch.worker import _prints

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:6563: Connection reset by peer. This is typically caused by a remote worker hanging")


def _failure(rank: int, code: int, ts: int) -> ProcessFailure:
    f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
    f.timestamp = ts
    return f


def test_the_final_summary_names_root_failures_not_their_victims():
    sigterm = -int(signal.SIGTERM)
    err = ChildFailedError("megashard.launch.worker", {0: _failure(0, sigterm, 10), 1: _failure(1, 1, 9),
                                                      2: _failure(2, EXIT_PEER_LOST, 8), 3: _failure(3, sigterm, 10)})
    assert _summary(err, 1) == "rank 1 failed (exit code 1); no restarts left (launch.max_restarts=1)"
    err = ChildFailedError("w", {0: _failure(0, 2, 5), 2: _failure(2, 2, 5), 1: _failure(1, -9, 4)})
    assert _summary(err, 0) == "rank 1 failed (killed by SIGKILL); ranks 0, 2 failed (exit code 2); " \
                               "no restarts (launch.max_restarts=0)"
    only_victims = ChildFailedError("w", {3: _failure(3, EXIT_PEER_LOST, 1)})
    assert _summary(only_victims, 2).startswith("rank 3 failed (lost its peers); no restarts left")


def test_exit_codes_read_as_words():
    assert describe_exit(1) == "exit code 1" and describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(EXIT_PEER_LOST) == "lost its peers" and describe_exit(-200) == "killed by signal 200"


def test_peer_loss_is_found_through_the_cause_chain():
    assert is_peer_loss(RuntimeError(GLOO_RESET))
    assert is_peer_loss(dist.DistNetworkError("failed to reach the store"))
    try:
        try:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:36239")
        except RuntimeError as inner:
            raise CheckpointCorruptedError("save failed") from inner
    except CheckpointCorruptedError as outer:
        assert is_peer_loss(outer)
    assert not is_peer_loss(RuntimeError("CUDA out of memory"))
    assert not is_peer_loss(ValueError("shape mismatch"))
    assert not is_peer_loss(RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete"))


@pytest.mark.parametrize("err,env,printed", [
    (ConfigError("model.heads=3"), {"RANK": "2", "LOCAL_RANK": "2"}, True),            # this rank's own error
    (CheckpointCorruptedError("(raised on rank 0) x: damaged"), {"RANK": "0"}, True),   # the rank it came from
    (CheckpointCorruptedError("(raised on rank 0) x: damaged"), {"RANK": "3"}, False),  # a copy
    (RankMismatchError("ranks disagree"), {"RANK": "4", "LOCAL_RANK": "0"}, True),      # once per node
    (RankMismatchError("ranks disagree"), {"RANK": "5", "LOCAL_RANK": "1"}, False),
])
def test_an_error_every_rank_raises_alike_is_printed_once(monkeypatch, err, env, printed):
    for k in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _prints(err, RankMismatchError) is printed


def _record(level: int, msg: str, *args) -> "logging.LogRecord":
    import logging

    return logging.LogRecord("torch.distributed.elastic.x", level, __file__, 1, msg, args, None)


def test_torchrun_log_records_become_one_line_per_restart(capsys):
    import logging

    from megashard.launch.agent import _Reporter

    # torch's own templates (torch/distributed/elastic/multiprocessing/api.py, agent/server/api.py)
    failed = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    restart = "[%s] Worker group %s. %s/%s attempts left; will restart worker group"
    single = _Reporter("1:1", "vm")
    single.emit(_record(logging.WARNING, "Sending process %s closing signal %s", 12, "SIGTERM"))
    single.emit(_record(logging.ERROR, failed, 1, 3, 4321, "/usr/bin/python"))
    single.emit(_record(logging.INFO, restart, "default", "FAILED", 2, 3))
    single.emit(_record(logging.INFO, "[%s] starting workers for entrypoint: %s", "default", "python"))
    single.emit(_record(logging.WARNING, "rendezvous round %s timed out", 4))
    multi = _Reporter("2", "node7")
    multi.emit(_record(logging.ERROR, failed, EXIT_PEER_LOST, 0, 99, "python"))
    multi.emit(_record(logging.INFO, restart, "default", "FAILED", 1, 1))
    assert capsys.readouterr().err.splitlines() == [
        "megashard run: rank 3 failed (exit code 1); the other ranks lost their peers; torchrun restarts the job "
        "from the newest checkpoint (restart 2 of 3)",
        "megashard run: torchrun: rendezvous round 4 timed out",
        "megashard run: local rank 0 on node7 lost its peers (a worker on another node failed); torchrun restarts "
        "the job from the newest checkpoint (restart 1 of 1)",
    ]
