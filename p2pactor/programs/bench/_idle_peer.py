"""One process of the ``idle`` section: a node, ours or vLLM's, idle with one peer connected.

``python -m p2pactor.programs.bench._idle_peer --side ours|vllm --port N [--peer-port M]``,
on 127.0.0.1 over real ZeroMQ and real NIXL. Each process holds
:data:`PRELOAD` blocks of :data:`BLOCK_LEN` bytes (the keys and bytes of
:mod:`p2pactor.programs.bench._control_peer`) in an
:class:`~p2pactor.runtime.parent.EmbeddedCache`, like ``p2pactor serve --preload 64``.
It prints ``READY`` once it is set up and bound. With ``--peer-port`` it then
waits for one line on stdin (the peer is bound by then) and does one request
against that peer, so that the session is established and the data plane has
been used: a lookup of :data:`WARM_KEYS` keys (all must be HIT), a fetch of
their blocks (every byte checked), the request finished; it answers ``{"ok":
true}``, or ``{"error": why}``. Then it does nothing more than an idle engine
would, until its stdin closes:

* ``ours``: a p2pactor node (``open_node`` with the cache as its embedded
  parent, default quotas, no event log, no dashboard): nothing calls it;
  whatever it spends is its own timers and transports.
* ``vllm``: vLLM 0.33.0's ``P2PSecondaryTierManager`` over the pool, and what
  vLLM's tier-poll thread does for an idle engine, every :data:`POLL_S`:
  ``has_pending_work()``, ``get_finished_jobs()`` (releasing finished jobs in
  the cache) and ``serve_external_requests(parent)`` with a vLLM
  ``ParentManager`` over the same cache class
  (:class:`~p2pactor.programs.bench._control_peer.CacheParent`). Its warm-up request is
  driven as vLLM's scheduler drives one (``on_new_request``, ``lookup`` until
  answered, ``submit_load`` of the hits, ``on_schedule_end`` every step,
  ``on_request_finished``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from p2pactor.programs.bench._control_peer import HASH_SEED, HOST, block_content, control_key

__all__ = ["BLOCK_LEN", "NUM_BLOCKS", "POLL_S", "PRELOAD", "WARM_KEYS", "main"]

PRELOAD = 64
"""Blocks each node holds (``p2pactor serve --preload 64``)."""
BLOCK_LEN = 4096
"""Bytes per block (NodeConfig's default, ``p2pactor serve``'s)."""
NUM_BLOCKS = 2 * PRELOAD
"""The pool: the preloaded blocks and room for the fetched copies."""
WARM_KEYS = 16
"""Keys of the one request that establishes the session."""
POLL_S = 0.001
"""vLLM's tier-poll interval."""
WARM_TIMEOUT_S = 90.0
"""The warm-up request must be done by then (the peer may still be importing vLLM)."""
LOAD_JOB = 10**9
"""The job id of the vLLM side's warm-up load (the cache's own ids count from 1)."""


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _keys() -> list[bytes]:
    return [control_key(i) for i in range(PRELOAD)]


def _fill(cache: Any) -> None:
    for i, key in enumerate(_keys()):
        cache.store(key, block_content(i, BLOCK_LEN))


class _WarmUpFailed(Exception):
    """The one request against the peer did not go as it must."""


def _check_blocks(memory: Any, blocks: Sequence[int]) -> None:
    """Every fetched block must hold what the peer stored under its key."""
    for i, block in enumerate(blocks):
        got = bytes(memory[block * BLOCK_LEN : (block + 1) * BLOCK_LEN])
        if got != block_content(i, BLOCK_LEN):
            raise _WarmUpFailed(f"the block of key {i} differs")


def _answer(error: str | None) -> None:
    _say(json.dumps({"error": error} if error else {"ok": True}))


# --- ours -------------------------------------------------------------------------------


async def _ours(args: argparse.Namespace) -> None:
    import trio  # noqa: PLC0415

    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
    from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415
    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.node import Node, open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.surface.attach import open_operator_surface  # noqa: PLC0415

    pool = bytearray(NUM_BLOCKS * BLOCK_LEN)
    cache = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN, memory=memoryview(pool))
    _fill(cache)
    config = NodeConfig(
        host=HOST, port=args.port, num_blocks=NUM_BLOCKS, block_len=BLOCK_LEN, hash_seed=HASH_SEED
    )

    async def warm_up(node: Node, peer: str, kv: str) -> None:
        wanted = _keys()[:WARM_KEYS]
        answers = await node.lookup(peer, kv, wanted)
        if any(a is not LookupResult.HIT for a in answers):
            raise _WarmUpFailed(f"the peer answered {answers}")
        blocks = cache.allocate(len(wanted))
        result = await node.fetch(peer, kv, wanted, blocks)
        if not result.success:
            raise _WarmUpFailed(f"the fetch failed: {result.reason}")
        _check_blocks(pool, blocks)
        cache.free(blocks)

    async with (
        open_zmq_transport(f"{HOST}:{args.port}", port=args.port) as control,
        open_nixl_transport(pool, BLOCK_LEN, name=f"bench-idle-{os.getpid()}") as data,
        open_node(config, control=control, data=data, parent=cache) as node,
        open_operator_surface(node),  # as serve runs one: with its metrics
    ):
        _say("READY")
        if args.peer_port:
            await trio.to_thread.run_sync(sys.stdin.readline)  # the peer is bound now
            peer, kv = f"{HOST}:{args.peer_port}", "idle-warm-up"
            error = None
            try:
                with trio.fail_after(WARM_TIMEOUT_S):
                    await warm_up(node, peer, kv)
            except (_WarmUpFailed, trio.TooSlowError) as exc:
                error = str(exc) or type(exc).__name__
            node.finish(kv)
            _answer(error)
        await trio.to_thread.run_sync(sys.stdin.read)


# --- vLLM -------------------------------------------------------------------------------


def _vllm(args: argparse.Namespace) -> None:
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    import numpy as np  # noqa: PLC0415

    from p2pactor.programs.bench import _vllm_tier as shared  # noqa: PLC0415 - imports vLLM
    from p2pactor.programs.bench._control_peer import CacheParent  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415

    vbase = sys.modules["vllm.v1.kv_offload.base"]
    tbase = sys.modules["vllm.v1.kv_offload.tiering.base"]

    pool = np.zeros((NUM_BLOCKS, BLOCK_LEN), dtype=np.uint8)
    cache = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN, memory=pool.data.cast("B"))
    _fill(cache)
    tier = shared.make_tier("vllm", pool, args.port)
    parent = CacheParent(
        cache, tbase.TransferJob, vbase.RequestOffloadingContext, vbase.LookupResult
    )
    loads: dict[int, bool] = {}

    def poll_round() -> None:
        """What vLLM's tier-poll thread does each round."""
        tier.has_pending_work()
        for result in tier.get_finished_jobs():
            job = int(result.job_id)
            if job == LOAD_JOB:
                loads[job] = bool(result.success)
            else:  # a peer's fetch from our cache is over: unpin
                cache.release_job(job, success=bool(result.success))
        tier.serve_external_requests(parent)

    _say("READY")
    if args.peer_port:
        sys.stdin.readline()  # the peer is bound now
        try:
            _vllm_warm_up(args, tier, cache, pool, poll_round, loads, vbase, tbase)
        except _WarmUpFailed as exc:
            _answer(str(exc))
        else:
            _answer(None)
    stop = threading.Event()

    def watch() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    while not stop.wait(POLL_S):
        poll_round()
    tier.shutdown()


def _vllm_warm_up(  # noqa: PLR0917 - the pieces _vllm built, handed over as they are
    args: argparse.Namespace,
    tier: Any,
    cache: Any,
    pool: Any,
    poll_round: Any,
    loads: dict[int, bool],
    vbase: Any,
    tbase: Any,
) -> None:
    """One request against the peer, as vLLM's scheduler drives it: lookup, load, finish."""
    import numpy as np  # noqa: PLC0415

    source = {"remote_host": HOST, "remote_port": args.peer_port, "kv_request_id": "idle-warm-up"}
    ctx = vbase.ReqContext(req_id="idle-warm-up", kv_transfer_params={"remote_kv_source": source})
    wanted = _keys()[:WARM_KEYS]
    deadline = time.monotonic() + WARM_TIMEOUT_S
    new_ids = [ctx.req_id]

    def step() -> None:
        tier.on_schedule_end(
            vbase.ScheduleEndContext(new_req_ids=list(new_ids), preempted_req_ids=())
        )
        new_ids.clear()
        poll_round()
        if time.monotonic() > deadline:
            raise _WarmUpFailed(f"no answer from the peer within {WARM_TIMEOUT_S:g} s")
        time.sleep(POLL_S)

    tier.on_new_request(ctx)
    for key in wanted:
        tier.lookup(key, ctx)  # registers the key: RETRY until the answer comes
    while tier.lookup(wanted[0], ctx) is vbase.LookupResult.RETRY:
        step()
    answers = [tier.lookup(k, ctx) for k in wanted]
    if any(a is not vbase.LookupResult.HIT for a in answers):
        raise _WarmUpFailed(f"the peer answered {answers}")
    blocks = cache.allocate(len(wanted))
    tier.submit_load(
        tbase.TransferJob(
            job_id=LOAD_JOB,
            keys=list(wanted),
            chunk_ids=np.array(blocks, dtype=np.int64),
            is_promotion=True,
            req_context=ctx,
        )
    )
    while LOAD_JOB not in loads:
        step()
    if not loads[LOAD_JOB]:
        raise _WarmUpFailed("the load failed")
    _check_blocks(pool.data.cast("B"), blocks)
    cache.free(blocks)
    tier.on_request_finished(ctx)
    for _ in range(10):  # the scheduler's next steps see the request gone
        step()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one idle node until its stdin closes."""
    parser = argparse.ArgumentParser(description="a process of the idle benchmark")
    parser.add_argument("--side", choices=("ours", "vllm"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--peer-port", type=int, default=0, help="the peer to do one request with")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.side == "ours":
        import trio  # noqa: PLC0415

        trio.run(_ours, args)
    else:
        _vllm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
