"""One engine of the fleet benchmark: a CPU tier of bounded size, a P2P tier, a scheduler.

:class:`FleetEngine` makes the calls vLLM's scheduler and offloading manager
make of a secondary tier, one step at a time (the order of
:mod:`p2pactor.programs.bench._vllm_scheduler`): a request's keys are looked
up in its own CPU tier first, the rest in the P2P tier, in order, past a
RETRY, up to the first MISS; the hit run is loaded into the CPU tier; what
is left is prefilled, and every block the request computed (its prompt's new
blocks and its reply) is stored in the CPU tier and cascaded to the P2P tier
(``submit_store``), as vLLM's manager does on ``complete_store``.

The CPU tier (:class:`Primary`) is an LRU of key -> chunk over a numpy pool;
chunks pinned for a peer's fetch or a cascade are never evicted until their
job is reported. Every computed block carries its key's first 16 bytes, so a
load that brought the wrong bytes is caught.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob

from p2pactor.programs.bench._fleet_workload import Turn

__all__ = ["STAMP_BYTES", "FleetEngine", "FleetRequest", "Primary"]

STAMP_BYTES = 16
"""The head of every computed block: its key's first bytes."""


class Primary:
    """An engine's CPU tier: ``capacity`` keys, least recently used evicted first."""

    def __init__(self, pool: np.ndarray, capacity: int) -> None:
        self.pool = pool
        self.capacity = capacity
        self.held: OrderedDict[bytes, int] = OrderedDict()
        self.free: deque[int] = deque(range(capacity))
        self.pinned: Counter[int] = Counter()
        self.evicted = 0

    def prefix(self, keys: Sequence[bytes], *, touch: bool = False) -> int:
        """How many of ``keys``, from the first, it holds (``touch``: and reuse them)."""
        n = 0
        for k in keys:
            if k not in self.held:
                break
            if touch:
                self.held.move_to_end(k)
            n += 1
        return n

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free chunks, evicting the least recently used unpinned keys; None if pinned."""
        while len(self.free) < n:
            victim = next((k for k, c in self.held.items() if not self.pinned[c]), None)
            if victim is None:
                return None
            self.free.append(self.held.pop(victim))
            self.evicted += 1
        return [self.free.popleft() for _ in range(n)]

    def release(self, chunks: Iterable[int]) -> None:
        """Chunks that were allocated and not filled go back."""
        self.free.extend(chunks)

    def put(self, key: bytes, chunk: int) -> None:
        """``chunk`` holds ``key`` now (the most recently used)."""
        self.held[key] = chunk

    def compute(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Prefill ``keys`` (those not held): stamp a chunk for each; what was stored."""
        new = [k for k in dict.fromkeys(keys) if k not in self.held]
        chunks = self.allocate(len(new)) or []
        stored = list(zip(new[: len(chunks)], chunks, strict=False))
        for k, c in stored:
            self.pool[c, :STAMP_BYTES] = np.frombuffer(k[:STAMP_BYTES], dtype=np.uint8)
            self.put(k, c)
        return stored

    def stamped(self, key: bytes, chunk: int) -> bool:
        """Whether ``chunk`` carries ``key``'s stamp."""
        return bytes(self.pool[chunk, :STAMP_BYTES]) == key[:STAMP_BYTES]


class _Parent(ParentManager):  # type: ignore[misc] # vLLM's types are Any to mypy
    """The CPU tier as a ``ParentManager``: what a peer's lookups and pins run against."""

    def __init__(self, engine: FleetEngine) -> None:
        self.engine = engine
        self.open: set[str] = set()

    def on_new_request(self, req_context: Any) -> Any:
        self.open.add(req_context.req_id)
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: Any) -> Any:
        del req_context
        held = bytes(key) in self.engine.primary.held
        return LookupResult.HIT if held else LookupResult.MISS

    def create_store_job(self, keys: Iterable[Any], req_context: Any) -> Any:
        keys = [bytes(k) for k in keys]
        chunks = [self.engine.primary.held[k] for k in keys]
        return self.engine.job("pin", keys, chunks, req_context)

    def on_request_finished(self, req_context: Any) -> None:
        self.open.discard(req_context.req_id)


@dataclass(eq=False)
class FleetRequest:
    """A turn on its engine, and what it saw."""

    turn: Turn
    ctx: ReqContext
    admitted: int
    local: int = 0
    claimed: bool | None = None  # auto-choice arms: did any peer claim its first key
    answers: list[LookupResult] = field(default_factory=list)
    hits: int = 0
    answered: int = -1
    loading: list[int] = field(default_factory=list)
    loaded: int = 0
    done: bool = False
    finished: int = -1


class FleetEngine:
    """One engine: its CPU tier, its P2P tier (or none), its requests, its counts."""

    def __init__(self, index: int, tier: Any, primary: Primary) -> None:
        self.index = index
        self.tier = tier
        self.primary = primary
        self.parent = _Parent(self)
        self.next_job = 1
        self.pins: dict[int, list[int]] = {}  # job id -> chunks pinned until reported
        self.loads: dict[int, FleetRequest] = {}
        self.waiting: list[FleetRequest] = []
        self.ready: list[FleetRequest] = []
        self.finished: list[FleetRequest] = []
        self.new_ids: list[str] = []
        self.counts: Counter[str] = Counter()

    # --- jobs ------------------------------------------------------------------------

    def job(self, kind: str, keys: Sequence[bytes], chunks: Sequence[int], ctx: Any) -> Any:
        """A job of this engine's: a pin or a store (pinned until reported) or a load."""
        job_id, self.next_job = self.next_job, self.next_job + 1
        if kind != "load":
            self.pins[job_id] = list(chunks)
            self.primary.pinned.update(chunks)
        return TransferJob(
            job_id=job_id,
            keys=list(keys),
            chunk_ids=np.array(chunks, dtype=np.int64),
            is_promotion=kind == "load",
            req_context=ctx,
        )

    def _reported(self, results: Iterable[Any]) -> None:
        for result in results:
            job_id = int(result.job_id)
            chunks = self.pins.pop(job_id, None)
            if chunks is not None:
                self.primary.pinned.subtract(chunks)
                continue
            req = self.loads.pop(job_id, None)
            if req is None:
                self.counts["unknown_jobs"] += 1
                continue
            keys = req.turn.keys[req.local : req.local + len(req.loading)]
            if result.success:
                self.counts["loads_ok"] += 1
                for k, c in zip(keys, req.loading, strict=True):
                    if not self.primary.stamped(k, c):
                        self.counts["wrong_blocks"] += 1
                    if k in self.primary.held:  # a request beside it brought it first
                        self.primary.release([c])
                    else:
                        self.primary.put(k, c)
                req.loaded = len(keys)
            else:
                self.counts["loads_failed"] += 1
                self.primary.release(req.loading)
            req.loading = []
            self.ready.append(req)

    # --- one step ------------------------------------------------------------------

    def admit(self, req: FleetRequest) -> None:
        """VLLM's ``add_request``: the tier hears of it; its CPU-tier prefix is reused."""
        if self.tier is not None:
            self.tier.on_new_request(req.ctx)
        keys = req.turn.keys
        req.local = self.primary.prefix(keys, touch=True)
        if req.local and self.tier is not None:
            self.tier.touch(keys[: req.local], req.ctx)
        self.new_ids.append(req.ctx.req_id)
        self.waiting.append(req)

    def step(self, step: int) -> None:
        """Step ``step``'s scheduling: results, lookups, peers served, loads, step end."""
        tier = self.tier
        if tier is not None:
            tier.has_pending_work()
            self._reported(tier.get_finished_jobs())
        still: list[FleetRequest] = []
        loads: list[Any] = []
        for req in self.waiting:
            if req.answered < 0:
                if not self._answered(req):
                    still.append(req)
                    continue
                req.answered = step
            if req.hits == 0:
                self.ready.append(req)
                continue
            chunks = self.primary.allocate(req.hits)
            if chunks is None:
                still.append(req)  # every chunk pinned: try next step
                continue
            req.loading = chunks
            job = self.job("load", req.turn.keys[req.local : req.local + req.hits], chunks, req.ctx)
            self.loads[int(job.job_id)] = req
            loads.append(job)
        self.waiting = still
        if tier is not None:
            tier.serve_external_requests(self.parent)
            for job in loads:
                tier.submit_load(job)
            tier.on_schedule_end(ScheduleEndContext(new_req_ids=self.new_ids, preempted_req_ids=()))
        self.new_ids = []

    def _answered(self, req: FleetRequest) -> bool:
        """Ask the P2P tier about the keys past the CPU tier's prefix (none: all MISS)."""
        keys = req.turn.keys[req.local :]
        if self.tier is None or not keys:
            req.hits = 0
            return True
        answers = req.answers
        if not answers and req.ctx.kv_transfer_params is None and hasattr(self.tier, "node"):
            node = self.tier.node  # what the tier's first lookup will find
            req.claimed = node.claimed(keys[0]) if node.shares_summaries else None
        retry = False
        for j, key in enumerate(keys):
            if j < len(answers) and answers[j] is LookupResult.HIT:
                continue
            answer = self.tier.lookup(key, req.ctx)
            if answer is LookupResult.HIT_PENDING:
                answer = LookupResult.HIT
            if j < len(answers):
                answers[j] = answer
            else:
                answers.append(answer)
            if answer is LookupResult.MISS:
                break
            if answer is LookupResult.RETRY:
                retry = True
        if retry:
            return False
        hits = 0
        while hits < len(answers) and answers[hits] is LookupResult.HIT:
            hits += 1
        req.hits = hits
        return True

    def end_step(self, step: int) -> list[FleetRequest]:
        """Output processing: the requests that can run prefill it, store, and finish."""
        ready, self.ready = self.ready, []
        for req in ready:
            turn = req.turn
            stored = self.primary.compute((*turn.keys, *turn.reply))
            self.counts["blocks_computed"] += len(stored)
            if stored and self.tier is not None:
                keys, chunks = zip(*stored, strict=True)
                self.tier.submit_store(self.job("store", keys, chunks, req.ctx))
            if self.tier is not None:
                self.tier.on_request_finished(req.ctx)
            req.done, req.finished = True, step
        self.finished += ready
        return ready

    # --- the end -------------------------------------------------------------------

    def settled(self) -> bool:
        """Nothing pinned, nothing loading, no peer's request open, the tier idle.

        vLLM's own tier says it has pending work for as long as it lives
        (its sessions are polled from the engine's steps): for it, idle is
        what its jobs and the parent's requests say.
        """
        busy = self.tier is not None and hasattr(self.tier, "node") and self.tier.has_pending_work()
        return not self.pins and not self.loads and not self.parent.open and not busy

    def poll(self) -> None:
        """A tier-poll round with no requests: results and peers served."""
        if self.tier is not None:
            self._reported(self.tier.get_finished_jobs())
            self.tier.serve_external_requests(self.parent)
            self.tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
