"""Which process a node is, and the watch on a peer's (``p2pactor/runtime/process.py``).

The watch is what lets a consumer end its late-write hold when the producer
dies on the same kernel and network (``tests/test_faults.py`` does it end to end):
a real child process is watched, killed, and seen to have exited; a process
that claims another host is never watched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from p2pactor.core import protocol as wire
from p2pactor.runtime.process import this_process, watch


def test_this_process_names_its_kernel_namespaces_and_pid() -> None:
    me = this_process()
    assert isinstance(me, wire.PeerProcess)
    assert me.pid == os.getpid()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert me.host.startswith(boot)
    assert f"net:{os.stat('/proc/self/ns/net').st_ino}" in me.host
    # It survives the wire: a peer reads it back from the connect's extension.
    ext = wire.ConnectExtension(version=1, process=me)
    connect = wire.Connect(
        peer_id="a:1",
        agent_metadata=b"",
        base_addr=0,
        num_blocks=1,
        block_len=1,
        hash_seed="s",
        extension=ext,
    )
    assert wire.decode(wire.encode(connect)) == connect


async def test_a_watched_process_is_seen_to_exit() -> None:
    me = this_process()
    assert isinstance(me, wire.PeerProcess)
    child = await trio.lowlevel.open_process([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watched = watch(wire.PeerProcess(host=me.host, pid=child.pid))
        assert watched is not None
        assert not watched.exited()
        child.kill()
        with trio.fail_after(10):
            await watched.wait()
        assert watched.exited()
        watched.close()
        watched.close()  # idempotent
    finally:
        child.kill()
        await child.wait()


@pytest.mark.parametrize(
    "claim",
    ["another host", "this process", "unset"],
)
def test_what_cannot_be_watched_is_not(claim: str) -> None:
    me = this_process()
    assert isinstance(me, wire.PeerProcess)
    process: wire.PeerProcess | wire.UnsetType = {
        "another host": wire.PeerProcess(host=f"{me.host}-elsewhere", pid=1),
        "this process": me,
        "unset": wire.UNSET,
    }[claim]
    assert watch(process) is None
