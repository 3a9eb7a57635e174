"""Abort gloo process groups for real: ``ProcessGroup.abort()`` does nothing on gloo (torch 2.11..2.13 at least:
``ProcessGroupGloo`` keeps ``Backend::abort``'s empty default; ``shutdown`` and ``set_timeout`` do not wake a
collective in flight either), so a collective waiting for a message from a peer that is alive but gone elsewhere (a
survivor that already left the broken world) waits the group's whole timeout (``parallel.timeout``).

What does wake it is the connection: gloo's pairs are TCP sockets, and a pair whose socket is shut down fails every
operation on it at once, on both ends ("Connection closed by peer"). Every gloo pair has one end accepted on a gloo
device's listening socket; so a process that shuts down the connections accepted on its own gloo listeners breaks
every pair it accepted, and when every surviving process does so, every pair between survivors is broken (pairs with
a dead process are broken already). The listeners are told apart from anything else listening in the process by
when they appeared: the ones opened since :func:`listening_now` was taken, at the start of a world.

Linux only (``/proc``); elsewhere :func:`shut_down_gloo_connections` does nothing and a blocked collective waits its
timeout, as before.
"""
from __future__ import annotations

import os
import socket

__all__ = ["listening_now", "shut_down_gloo_connections"]

_LISTEN, _ESTABLISHED = "0A", "01"


def _socket_fds() -> dict[int, int]:
    """``{socket inode: fd}`` of this process's open sockets."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def _tcp_table() -> list[tuple[int, int, str]]:
    """``(inode, local port, state)`` of every TCP socket of this network namespace (IPv4 and IPv6)."""
    rows = []
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(path, encoding="ascii") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            try:
                rows.append((int(parts[9]), int(parts[1].rsplit(":", 1)[1], 16), parts[3]))
            except (IndexError, ValueError):
                continue
    return rows


def listening_now() -> frozenset:
    """The inodes of the TCP sockets this process listens on now (taken before a world's groups are made)."""
    mine = _socket_fds()
    return frozenset(inode for inode, _, state in _tcp_table() if state == _LISTEN and inode in mine)


def shut_down_gloo_connections(before: frozenset) -> int:
    """Shut down (``SHUT_RDWR``, both directions; the file descriptors stay gloo's to close) every connection this
    process accepted on a socket it started listening on after ``before`` (:func:`listening_now`): the gloo pairs of
    the world formed since. Returns how many were shut down."""
    mine = _socket_fds()
    table = _tcp_table()
    ports = {port for inode, port, state in table if state == _LISTEN and inode in mine and inode not in before}
    n = 0
    for inode, port, state in table:
        if state != _ESTABLISHED or port not in ports or inode not in mine:
            continue
        try:
            dup = socket.socket(fileno=os.dup(mine[inode]))
        except OSError:
            continue
        try:
            dup.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:  # already closed by the peer
            pass
        finally:
            dup.close()  # only the duplicate: gloo closes its own descriptor
    return n
