"""The liar row of the ``summary-attack`` section: a peer that answers HIT and never delivers.

Here the node under attack is the one that chooses its sources itself: a
p2pactor node in this process (real ZeroMQ and NIXL on 127.0.0.1, an
embedded cache to fetch into, no peer but the liar). The liar
(:mod:`p2pactor.programs.bench._hostile` ``--attack liar``, a process of
its own) dials it, claims in its summary the keys of ``p2pactor serve
--preload``, answers HIT to every lookup and fails every fetch
(``transfer_done(success=false)``). The node then runs requests that name no
source, each :meth:`~p2pactor.runtime.node.Node.locate` of 10 claimed keys and
a fetch of its hits, until ``locate`` no longer chooses the liar: the
requests it sent to the liar are the misrouted ones (issue 30: 80 of 80,
never quarantined; target at most 10).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from p2pactor.programs.bench._control_common import open_bench_node
from p2pactor.programs.bench._summary_drive import HostileProcess

KEYS_PER_REQUEST = 10
"""Keys each request looks up (the claimed run the node asks the liar for)."""
CLAIMED = 400
"""Keys the liar claims: enough for every request to ask fresh ones."""
POOL_BLOCKS = 64


@attrs.frozen(kw_only=True)
class LiarResult:
    """How many requests the liar got before the node stopped choosing it."""

    misrouted: int
    """Requests the node sent to the liar (each answered HIT, each fetch failed)."""
    quarantined: bool
    """Whether the node stopped choosing it within ``limit`` requests."""
    reason: str
    """Why the node chose nobody at the end (the choice's reason)."""
    failed_fetches: int
    """Of the misrouted requests, those whose fetch failed (all, for a liar)."""
    liar: dict[str, object]
    """What the liar said it did (lookups answered, fetches failed)."""
    seconds: float


async def _consume(
    port: int, settings: dict[str, object], hostile: HostileProcess, limit: int
) -> tuple[int, bool, str, int, dict[str, Any]]:
    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.runtime.samples import preload_keys  # noqa: PLC0415

    block_len = int(str(settings["block_len"]))
    seed = str(settings["hash_seed"])
    keys = preload_keys(seed, CLAIMED)
    pool = bytearray(POOL_BLOCKS * block_len)
    cache = EmbeddedCache(POOL_BLOCKS, block_len, memory=memoryview(pool))
    misrouted = failed = 0
    quarantined, reason = False, ""
    async with (
        open_bench_node(
            port,
            pool,
            block_len,
            name=f"summary-consumer-{os.getpid()}",
            parent=cache,
            hash_seed=seed,
        ) as node,
    ):
        hostile.go()  # now the liar dials us
        await trio.to_thread.run_sync(hostile.expect, "READY")
        await trio.to_thread.run_sync(hostile.expect, "CLAIMED")  # its summary is applied
        for i in range(limit + 1):
            kv = f"auto-{i}"
            first = (i * KEYS_PER_REQUEST) % (CLAIMED - KEYS_PER_REQUEST)
            wanted = keys[first : first + KEYS_PER_REQUEST]
            located = await node.locate(kv, wanted)
            if located.peer is None:
                quarantined, reason = True, located.choice.reason
                node.finish(kv)
                break
            misrouted += 1
            hits = [
                k for k, a in zip(wanted, located.answers, strict=True) if a is LookupResult.HIT
            ]
            blocks = cache.allocate(len(hits))
            try:
                result = await node.fetch(located.peer, kv, hits, blocks)
                failed += not result.success
            finally:
                cache.free(blocks)
                node.finish(kv)
        # The liar leaves first: our node's close would disconnect it mid-lie.
        said = await trio.to_thread.run_sync(hostile.leave)
    return misrouted, quarantined, reason, failed, said


def run_liar(
    *,
    port: int,
    block_len: int,
    hash_seed: str,
    work_dir: Path,
    limit: int = 40,
) -> LiarResult:
    """Run the liar row: a consumer node on ``port``, the liar dialing it; count the misrouted.

    ``limit``: requests to the liar after which the node is taken never to
    quarantine it (issue 30's run stopped at 80).
    """
    t0 = time.perf_counter()
    hostile = HostileProcess(
        f"127.0.0.1:{port}",
        "liar",
        ["--paced", f"--hash-seed={hash_seed}", f"--block-len={block_len}", f"--claims={CLAIMED}"],
        work_dir / f"hostile-liar-{time.time_ns()}.err",
    )
    try:
        hostile.expect("LOADED", timeout=120)
        settings: dict[str, object] = {"block_len": block_len, "hash_seed": hash_seed}
        misrouted, quarantined, reason, failed, said = trio.run(
            _consume, port, settings, hostile, limit
        )
    finally:
        hostile.kill()
    return LiarResult(
        misrouted=misrouted,
        quarantined=quarantined,
        reason=reason,
        failed_fetches=failed,
        liar=dict(said.get("DONE", {})),
        seconds=time.perf_counter() - t0,
    )
