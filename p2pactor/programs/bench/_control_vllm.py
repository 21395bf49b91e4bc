"""The vLLM side of :mod:`p2pactor.programs.bench._control_peer`: vLLM 0.33.0's own tier.

Its ``P2PSecondaryTierManager`` as producer or consumer (that module's docstring says
what each role does), and :class:`CacheParent`, a vLLM ``ParentManager`` over the same
cache class as ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

from p2pactor.programs.bench._control_common import say
from p2pactor.programs.bench._control_peer import (
    BLOCK_LEN,
    CONSUMER_BLOCKS,
    HASH_SEED,
    HOST,
    NUM_KEYS,
    Tally,
    fill,
    key_window,
    producer_counters,
    ready,
)
from p2pactor.runtime.parent import EmbeddedCache


def run_vllm(args: argparse.Namespace) -> None:
    """Run vLLM's producer or consumer of the ``control`` section until its stdin closes."""
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    import numpy as np  # noqa: PLC0415
    import zmq  # noqa: PLC0415

    from p2pactor.programs.bench import _vllm_tier as shared  # noqa: PLC0415 - imports vLLM

    vbase = sys.modules["vllm.v1.kv_offload.base"]
    tbase = sys.modules["vllm.v1.kv_offload.tiering.base"]
    LookupResult, ReqContext = vbase.LookupResult, vbase.ReqContext  # noqa: N806
    ScheduleEndContext = vbase.ScheduleEndContext  # noqa: N806

    producer = args.role == "producer"
    blocks = NUM_KEYS if producer else CONSUMER_BLOCKS
    pool = np.zeros((blocks, BLOCK_LEN), dtype=np.uint8)
    cache = EmbeddedCache(blocks, BLOCK_LEN, memory=pool.data.cast("B"))
    if producer:
        fill(cache)
    tier = shared.make_tier("vllm", pool, args.port)
    poller = zmq.Poller()
    poller.register(tier._control._router, zmq.POLLIN)
    stop = threading.Event()

    def watch() -> None:
        if producer:
            sys.stdin.read()
            stop.set()

    ready()
    if producer:
        parent = CacheParent(cache, tbase.TransferJob, vbase.RequestOffloadingContext, LookupResult)
        threading.Thread(target=watch, daemon=True).start()
        while not stop.is_set():
            poller.poll(1)  # vLLM's tier-poll interval, unless a message arrives first
            for result in tier.get_finished_jobs():
                cache.release_job(int(result.job_id), success=bool(result.success))
            tier.serve_external_requests(parent)
        tier.shutdown()
        say(producer_counters(cache))
        return

    source = {"remote_host": HOST, "remote_port": args.peer_port}
    counter = iter(range(10**12))
    retry, hit = LookupResult.RETRY, LookupResult.HIT
    while True:
        line = sys.stdin.readline()
        if not line:
            tier.shutdown()
            return
        cmd = json.loads(line)
        if "idle" in cmd:  # as vLLM's tier-poll thread calls an idle engine's tier
            end = time.perf_counter() + float(cmd["idle"])
            while time.perf_counter() < end:
                poller.poll(1)
                tier.has_pending_work()
                tier.get_finished_jobs()
            say({})
            continue
        tally = Tally(cmd)
        # in flight: (context, keys, start time)
        flight: list[tuple[Any, list[bytes], float]] = []
        new_ids: list[str] = []

        def begin(
            keys: int,
            flight: list[tuple[Any, list[bytes], float]],
            new_ids: list[str],
        ) -> None:
            n = next(counter)
            ctx = ReqContext(
                req_id=f"req-{n}",
                kv_transfer_params={"remote_kv_source": {**source, "kv_request_id": f"bench-{n}"}},
            )
            wanted = key_window(n, keys)
            t0 = time.perf_counter()
            tier.on_new_request(ctx)
            for key in wanted:
                tier.lookup(key, ctx)  # registers the key: RETRY until the answer comes
            flight.append((ctx, wanted, t0))
            new_ids.append(ctx.req_id)

        for _ in range(tally.conc):
            begin(tally.keys, flight, new_ids)
        while flight:
            tier.on_schedule_end(
                ScheduleEndContext(new_req_ids=list(new_ids), preempted_req_ids=())
            )
            new_ids.clear()
            poller.poll(1)
            tier.get_finished_jobs()
            still = []
            for ctx, wanted, t0 in flight:
                # One LookupResp answers every key of the request at once.
                if tier.lookup(wanted[0], ctx) is retry:
                    still.append((ctx, wanted, t0))
                    continue
                answers = [tier.lookup(k, ctx) for k in wanted]
                t1 = time.perf_counter()
                tally.add(t1 - t0, t1, sum(1 for a in answers if a is hit), len(answers))
                tier.on_request_finished(ctx)
            done = len(flight) - len(still)
            flight = still
            if time.perf_counter() < tally.deadline:
                for _ in range(done):
                    begin(tally.keys, flight, new_ids)
        say(tally.result())


class CacheParent:
    """VLLM's ``ParentManager`` over an :class:`~p2pactor.runtime.parent.EmbeddedCache`.

    The same cache class our producer serves from, so both producers do the
    same work per key (a dict lookup, a pin per job). Built on the fly (vLLM's
    classes are passed in) so that this module imports without vLLM; the tier
    only calls these four methods.
    """

    def __init__(self, cache: Any, job_cls: Any, ctx_cls: Any, results: Any) -> None:
        self._cache = cache
        self._job = job_cls
        self._ctx = ctx_cls
        self._results = {
            "HIT": results.HIT,
            "MISS": results.MISS,
            "HIT_PENDING": results.HIT_PENDING,
            "RETRY": results.RETRY,
        }

    def on_new_request(self, req_context: Any) -> Any:
        """Open the synthetic request of a peer's lookup."""
        self._cache.on_new_request(req_context.req_id)
        return self._ctx()

    def lookup(self, key: Any, req_context: Any) -> Any:
        """The cache's answer, as vLLM's LookupResult."""
        return self._results[self._cache.lookup(bytes(key), req_context.req_id).name]

    def create_store_job(self, keys: Any, req_context: Any) -> Any:
        """Pin the blocks of ``keys``; the tier reports the job when it lets go."""
        import numpy as np  # noqa: PLC0415

        keys = [bytes(k) for k in keys]
        pin = self._cache.create_store_job(keys, req_context.req_id)
        return self._job(
            job_id=pin.job_id,
            keys=keys,
            chunk_ids=np.array(pin.blocks, dtype=np.int64),
            is_promotion=False,
            req_context=req_context,
        )

    def on_request_finished(self, req_context: Any) -> None:
        """Close the synthetic request."""
        self._cache.on_request_finished(req_context.req_id)
