"""Which process this node is, and whether a peer's process still runs.

A p2pactor node names its process in its ``connect``
(:class:`~p2pactor.core.protocol.PeerProcess`): the kernel's boot id, its PID and
network namespaces, its pid. A peer that finds the same ``host`` shares that
kernel and both namespaces with it, so the only path between the two is that
kernel's (loopback, shared memory), which no cut link can hold a write on. It
holds a pidfd on the process (:func:`watch`), which tells when it has exited:
from then on it writes nothing, and once our side of the data path has let it
go, nothing it wrote before can land either. Elsewhere (another host, another
namespace, a stock vLLM peer, a kernel without pidfds) nothing is watched.
"""

from __future__ import annotations

import functools
import os
import select
from pathlib import Path

import trio

from p2pactor.core import protocol as wire


@functools.cache
def _host() -> str | None:
    """This kernel and this process's PID and network namespaces, or None if unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
        net_ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{boot}/pid:{pid_ns}/net:{net_ns}"


def this_process() -> wire.PeerProcess | wire.UnsetType:
    """What this node says of its process in its ``connect`` (UNSET where it can't tell)."""
    host = _host()
    # The pid is read each time: a forked child is another process.
    return wire.UNSET if host is None else wire.PeerProcess(host=host, pid=os.getpid())


class ProcessWatch:
    """A pidfd on a peer's process: whether it has exited, and a wait until it has."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def exited(self) -> bool:
        """Whether the process has exited (its pidfd is readable). Never blocks."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    async def wait(self) -> None:
        """Return once the process has exited."""
        await trio.lowlevel.wait_readable(self._fd)

    def close(self) -> None:
        """Let the pidfd go. Idempotent."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            trio.lowlevel.notify_closing(fd)  # a task waiting on it wakes, not hangs
            os.close(fd)


def watch(process: wire.PeerProcess | wire.UnsetType) -> ProcessWatch | None:
    """A watch on a peer's ``process``, where only this kernel lies between us; else None."""
    host = _host()
    if not isinstance(process, wire.PeerProcess) or host is None or process.host != host:
        return None
    if process.pid == os.getpid():
        return None  # two nodes of one process: it outlives neither
    try:
        fd = os.pidfd_open(process.pid)
    except (OSError, AttributeError):  # gone already (a pid maybe reused), or no pidfds
        return None
    return ProcessWatch(fd)
