"""``megashard._compat.rendezvous_forget_lost`` against torch's own dynamic rendezvous (issue 36): two nodes complete a
round through a real ``DynamicRendezvousHandler`` on a c10d store; one node's heartbeats stop (its agent killed); the
survivor's call gives the lost participant a heartbeat of long ago in torch's shared state, written with torch's
compare-and-set, so that torch's next sync drops it — and a third node that comes to join a full round (max_nodes
participants) is counted as waiting at once, instead of standing on the redundancy list until the lost node's
heartbeat timeout (30 s here), and the survivor completes the next round with it. What it must never do is tested too: mark a node
that is not named, act for a node that is itself named, or write into a later round.

Private torch API (the handler's state holder and heartbeat lock) lives in megashard/_compat/elastic.py; this test
fails loudly on a torch whose rendezvous changed shape.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

RUN = "forget-test"


def _handler(host, addr: str, min_nodes: int = 2, max_nodes: int = 3):
    """A node's handler, with a store client of its own (one client is not shared between threads)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    # torch drops a node whose heartbeats stopped keep_alive_interval · keep_alive_max_attempt after its last one
    # (launch.rdzv_node_timeout): 5 s · 6 here, so without the call under test a lost node holds its place for 30 s
    timeout = RendezvousTimeout(join=timedelta(seconds=60), last_call=timedelta(seconds=0.5),
                                close=timedelta(seconds=5), heartbeat=timedelta(seconds=60))
    store = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=30))
    return DynamicRendezvousHandler.from_backend(RUN, store, C10dRendezvousBackend(store, RUN), min_nodes, max_nodes,
                                                 local_addr=addr, timeout=timeout, keep_alive_interval=5,
                                                 keep_alive_max_attempt=6)


def _join_all(handlers) -> None:
    errors: list = []

    def join(h) -> None:
        try:
            h.next_rendezvous()
        except Exception as e:  # noqa: BLE001 - reported below with the node
            errors.append((h._this_node, e))

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors


def _name(h) -> str:
    return f"{h._this_node.addr}:{h._this_node.pid}"


@pytest.fixture
def store():
    import torch.distributed as dist

    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield s


def test_a_lost_node_is_dropped_and_a_newcomer_is_counted_as_waiting_at_once(store, monkeypatch):
    from megashard._compat import rendezvous_forget_lost

    # the nodes of this test are threads of one process: no shared TCP store server for the workers (their bootstrap
    # store, which this test does not use, is published per round instead)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    a, b = _handler(store, "127.0.0.1", max_nodes=2), _handler(store, "127.0.0.2", max_nodes=2)
    _join_all([a, b])
    state = a._state_holder.state
    round_ = state.round
    assert state.complete and len(state.participants) == 2
    b._stop_heartbeats()  # node B's agent is killed: its heartbeats stop, its place stays

    # never: a round that is not the one decided, a node that is itself named, a node not named
    assert rendezvous_forget_lost(a, round_ + 1, {_name(b)}) == []
    assert rendezvous_forget_lost(a, round_, {_name(a)}) == []
    assert rendezvous_forget_lost(a, round_, {"node-x:1"}) == []
    a._state_holder.sync()
    assert all(hb.year > 2000 for hb in a._state_holder.state.last_heartbeats.values())

    assert rendezvous_forget_lost(a, round_, {_name(b)}) == [_name(b)]
    a._state_holder.sync()  # torch's own sync drops a participant whose heartbeat is too old
    assert [n.addr for n in a._state_holder.state.participants] == ["127.0.0.1"]
    assert rendezvous_forget_lost(a, round_, {_name(b)}) == []  # done once: nothing left to mark

    # a newcomer: the round is full (max_nodes = 2) while B is a participant, so C would stand on the redundancy list
    # and A's agent would see nobody waiting for 30 s; with B dropped, C waits to join and A's agent
    # (megashard's live agent: on_join) completes the next round with it
    c = _handler(store, "127.0.0.3", max_nodes=2)
    joined = threading.Thread(target=c.next_rendezvous, daemon=True)
    joined.start()
    t0 = time.monotonic()
    while a.num_nodes_waiting() == 0:
        assert time.monotonic() - t0 < 25, "the newcomer is not counted as waiting (the lost node holds its place)"
        time.sleep(0.1)
    _join_all([a])
    joined.join(timeout=30)
    state = a._state_holder.state
    assert not joined.is_alive() and state.round == round_ + 1
    assert sorted(n.addr for n in state.participants) == ["127.0.0.1", "127.0.0.3"]
    for h in (a, b, c):
        h._stop_heartbeats()
