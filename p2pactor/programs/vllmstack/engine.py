"""An engine's scheduler over vLLM's stack: the calls vLLM's connector scheduler makes.

:class:`StackEngine` steps requests through a :class:`~p2pactor.programs.vllmstack.build.Stack`
the way vLLM 0.33's connector scheduler drives its manager (``offloading/scheduler.py``):

* ``add``: ``manager.on_new_request(ctx)`` (the request's keys carry their
  end-token positions on ``ctx``, as ``update_offload_keys`` records them);
* each :meth:`~StackEngine.step`, holding the manager lock for the whole
  schedule (``_acquire_step`` to ``build_connector_meta``):

  - every waiting request with no job in flight is looked up from its
    computed prefix (``get_num_new_matched_tokens`` -> ``_maximal_prefix_lookup``:
    ``manager.lookup`` per key, HIT and HIT_PENDING count, a RETRY defers but
    the scan goes on, the first MISS ends it); a deferred request is asked
    again next step, and so is one whose hit chunks another request is
    loading (``_chunks_being_loaded``);
  - a hit run is pinned with ``manager.prepare_load`` (``update_state_after_alloc``)
    and loaded by the worker this step; once loaded, the request is looked
    up again from there (vLLM asks the first missed key again) before it runs;
  - a request with nothing (more) to load runs: its prompt's other chunks and
    its reply are computed by this step's forward pass;
  - ``build_connector_meta``: the chunks a request computed last step are
    stored (``manager.prepare_store``; None, every chunk pinned, is tried again
    next step), and then, its last stores issued, ``manager.on_request_finished``;
    last, ``manager.on_schedule_end(ScheduleEndContext(new, ()))``;

* the worker, without the lock: a load copies its CPU chunks out and checks
  every byte against the key's contents (:func:`fill`), a store writes them in;
* ``update_connector_output``, holding the lock: ``complete_load`` and
  ``complete_store`` for the jobs done, then ``manager.get_stats()`` as the
  engine's stats loop asks each step.

An engine with no request steps only while ``has_pending_work()`` (vLLM's
engine core blocks otherwise; its tier-poll thread still serves peers).

What it leaves out, for want of a model and a GPU: the GPU prefix cache
(every request starts with nothing computed), chunked prefill and budgets
(a prompt is computed in one step, its reply with it), preemption, sliding
windows and partial tails, sync loads. Real engines in the tests cover those
paths (``tests/test_vllm_real.py``).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from p2pactor.programs.vllmstack.build import Stack

__all__ = ["Phase", "StackEngine", "StackRequest", "fill"]


def fill(key: bytes, size: int) -> np.ndarray[Any, Any]:
    """The bytes a computed chunk of ``key`` holds: the key, repeated."""
    return np.resize(np.frombuffer(key, dtype=np.uint8), size)


class Phase(enum.Enum):
    """Where a request is."""

    WAITING = "waiting"  # looked up each step until its scan decides
    LOADING = "loading"  # its hit run is being loaded from the CPU tier
    RUNNING = "running"  # computed by this step's forward pass
    STORING = "storing"  # its chunks are being stored; finished
    DONE = "done"


@attrs.define(eq=False)
class StackRequest:
    """One request: its keys, its context, where it is and what it saw.

    Attributes:
        req_id: vLLM's request id.
        keys: Its prompt's keys, in order.
        reply: The keys of the reply it computes (stored after the prompt's).
        ctx: vLLM's ``ReqContext`` (its ``kv_transfer_params``, its key positions).
        admitted: The step it was added at.
        phase: Where it is.
        computed: Prompt chunks computed or loaded so far.
        loaded: Chunks loaded from the CPU tier, of which ``promoted`` a
            secondary tier brought (vLLM's ``get_load_source`` said so).
        scans: Lookup scans made; ``deferred``: how many deferred it, of which
            ``waited`` for a tier's answer (a RETRY: a tier is asking); the
            rest waited for a promotion under way (HIT_PENDING) or for chunks
            another request was loading.
        decided: The step its first scan decided (-1: not yet).
        finished: The step its compute ran (-1: not yet).
        wrong: Loaded chunks whose bytes were not its key's.
        aborted: The client gave up on it before it ran (:meth:`StackEngine.abort`).
    """

    req_id: str
    keys: tuple[bytes, ...]
    reply: tuple[bytes, ...]
    ctx: Any
    admitted: int
    phase: Phase = Phase.WAITING
    computed: int = 0
    loaded: int = 0
    promoted: int = 0
    scans: int = 0
    deferred: int = 0
    waited: int = 0
    decided: int = -1
    finished: int = -1
    wrong: int = 0
    aborted: bool = False
    _store_tries: int = 0


@attrs.define(eq=False)
class _Job:
    req: StackRequest
    keys: list[bytes]
    chunks: list[int]
    store: bool


_STORE_TRIES = 50  # a store vLLM cannot allocate for is dropped after this many steps


class StackEngine:
    """Requests stepped through a stack as vLLM's connector scheduler steps them.

    Args:
        stack: The engine's offloading stack.
        name: For request ids.
    """

    def __init__(self, stack: Stack, name: str = "engine") -> None:
        from vllm.v1.kv_offload.base import (  # noqa: PLC0415 - vLLM is optional
            LookupResult,
            ReqContext,
            ScheduleEndContext,
        )

        self._lookup = LookupResult
        self._ctx = ReqContext
        self._end = ScheduleEndContext
        self.stack = stack
        self.name = name
        self.steps = 0
        self.requests: list[StackRequest] = []
        self._new: list[str] = []
        self._loading: set[bytes] = set()  # vLLM's _chunks_being_loaded
        self._jobs: list[_Job] = []  # this step's, for the worker
        self._computed: list[StackRequest] = []  # ran last step: store, then finish
        self.stores_dropped = 0
        self.counters: Counter[tuple[str, tuple[str, ...]]] = Counter()
        """vLLM's counters (its ``/metrics``), summed: (name, label values) -> value."""

    # --- requests ----------------------------------------------------------------

    def add(
        self,
        req_id: str,
        keys: Sequence[bytes],
        reply: Sequence[bytes] = (),
        params: dict[str, Any] | None = None,
    ) -> StackRequest:
        """``add_request``: the manager hears of the request (its tiers read its params)."""
        ctx = self._ctx(req_id=req_id, kv_transfer_params=params)
        per = self.stack.options.tokens_per_chunk
        for i, key in enumerate((*keys, *reply)):
            ctx.set_offload_key_position(key, (i + 1) * per)
        req = StackRequest(req_id, tuple(keys), tuple(reply), ctx, self.steps)
        with self.stack.lock:
            self.stack.manager.on_new_request(ctx)
        self.requests.append(req)
        self._new.append(req_id)
        return req

    @property
    def busy(self) -> bool:
        """Whether a request is not done yet."""
        return any(r.phase is not Phase.DONE for r in self.requests)

    def has_pending_work(self) -> bool:
        """``has_pending_push_work``: jobs in flight, or the manager (its tiers) says so."""
        if self._jobs:
            return True
        with self.stack.lock:
            return bool(self.stack.manager.has_pending_work())

    def wants_step(self) -> bool:
        """Whether vLLM's engine core would step now (requests, or pending work)."""
        return self.busy or self.has_pending_work()

    # --- one step ------------------------------------------------------------------

    def step(self) -> list[StackRequest]:
        """Schedule, run the worker, take its output; the requests computed this step."""
        ran = self.begin()
        self.end()
        return ran

    def begin(self) -> list[StackRequest]:
        """``schedule()`` up to ``build_connector_meta``: the requests this step computes.

        The forward pass runs between :meth:`begin` and :meth:`end` (engines
        in lockstep share one).
        """
        manager = self.stack.manager
        with self.stack.lock:
            ran = self._schedule(manager)
            self._build_connector_meta(manager)
        return ran

    def end(self) -> None:
        """The worker's copies, then ``update_connector_output`` and the step's stats."""
        self._work()
        manager = self.stack.manager
        with self.stack.lock:
            self._update_connector_output(manager)
            stats = manager.get_stats()
        if stats is not None:
            self._count(stats)
        self.steps += 1

    def _count(self, stats: Any) -> None:
        """Add the step's counters to :attr:`counters` (vLLM's payload: types, then values)."""
        types, values = stats.data.get("types", {}), stats.data.get("data", {})
        counters = self.counters
        for name, kind in types.items():
            if kind == "counter":
                for labels, value in values.get(name, {}).items():
                    counters[name, labels] += value

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the CPU tier holds now (vLLM's primary lookup)."""
        primary, hit = self.stack.primary, self._lookup.HIT
        with self.stack.lock:
            n = 0
            for key in keys:
                if primary.lookup(key, None) is not hit:
                    break
                n += 1
        return n

    def _schedule(self, manager: Any) -> list[StackRequest]:
        ran: list[StackRequest] = []
        for req in self.requests:
            if req.phase is not Phase.WAITING:
                continue
            hits = self._scan(manager, req)
            if hits is None:
                req.deferred += 1
                continue
            if req.decided < 0:
                req.decided = self.steps
            keys = list(req.keys[req.computed : req.computed + hits])
            if not keys:
                req.phase, req.finished = Phase.RUNNING, self.steps
                ran.append(req)
                continue
            spec = manager.prepare_load(keys, req.ctx)
            sources = [manager.get_load_source(k, req.ctx) for k in keys]
            req.promoted += sum(1 for s in sources if getattr(s, "name", "") != "HOST")
            req.loaded += len(keys)
            self._loading.update(keys)
            self._jobs.append(_Job(req, keys, [int(c) for c in spec.chunk_ids], store=False))
            req.phase = Phase.LOADING
        return ran

    def _scan(self, manager: Any, req: StackRequest) -> int | None:
        """``_maximal_prefix_lookup`` from the computed prefix: the hit run, or None (deferred)."""
        req.scans += 1
        hit, pending, retry = self._lookup.HIT, self._lookup.HIT_PENDING, self._lookup.RETRY
        hits, deferred, asking = 0, False, False
        for key in req.keys[req.computed :]:
            result = manager.lookup(key, req.ctx)
            if result is hit or result is pending:
                hits += 1
                deferred |= result is pending
            elif result is retry:
                asking = True  # keep scanning: the tiers start their lookups
            else:
                break
        if asking:
            req.waited += 1
        if deferred or asking:
            return None
        if self._loading.intersection(req.keys[req.computed : req.computed + hits]):
            return None  # another request is loading them: wait for it
        return hits

    def _build_connector_meta(self, manager: Any) -> None:
        computed, self._computed = self._computed, []
        for req in computed:
            keys = [*req.keys[req.computed :], *req.reply]
            out = manager.prepare_store(keys, req.ctx) if keys else None
            if keys and out is None:
                req._store_tries += 1
                if req._store_tries < _STORE_TRIES:
                    self._computed.append(req)  # every chunk pinned: next step
                    continue
                self.stores_dropped += 1
            elif out is not None and out.keys_to_store:
                chunks = [int(c) for c in out.store_spec.chunk_ids]
                self._jobs.append(_Job(req, list(out.keys_to_store), chunks, store=True))
            manager.on_request_finished(req.ctx)
            req.phase = Phase.STORING
        for req in self.requests:
            if req.phase is Phase.RUNNING:
                self._computed.append(req)  # this step's forward pass computes it
        new, self._new = self._new, []
        manager.on_schedule_end(self._end(new_req_ids=new, preempted_req_ids=()))

    def _work(self) -> None:
        """The worker: loads copy CPU chunks out (every byte checked), stores write them."""
        memory = self.stack.memory
        size = memory.shape[1]
        for job in self._jobs:
            for key, chunk in zip(job.keys, job.chunks, strict=True):
                if job.store:
                    memory[chunk] = fill(key, size)
                elif not np.array_equal(memory[chunk], fill(key, size)):
                    job.req.wrong += 1
        del memory

    def _update_connector_output(self, manager: Any) -> None:
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            if job.store:
                manager.complete_store(job.keys, job.req.ctx)
                continue
            manager.complete_load(job.keys, job.req.ctx)
            self._loading.difference_update(job.keys)
            job.req.computed += len(job.keys)
            job.req.phase = Phase.WAITING  # looked up again from the first key not loaded
        # Every job of the step is done now: a request whose last stores were is done.
        for req in self.requests:
            if req.phase is Phase.STORING:
                req.phase = Phase.DONE
        self.requests = [r for r in self.requests if r.phase is not Phase.DONE]

    def abort(self, req: StackRequest) -> None:
        """The client gave up on a request still waiting: vLLM finishes it unrun."""
        if req.phase is not Phase.WAITING:
            return
        with self.stack.lock:
            self.stack.manager.on_request_finished(req.ctx)
        req.phase, req.aborted, req.finished = Phase.DONE, True, self.steps
        self.requests.remove(req)

    # --- helpers for tests -----------------------------------------------------------

    def compute(
        self, req_id: str, keys: Iterable[bytes], params: dict[str, Any] | None = None
    ) -> StackRequest:
        """A request that computes ``keys`` with no lookup: they end up stored, as vLLM would.

        Steps until it is done (stored in the CPU tier; vLLM cascades them to
        its tiers from the steps after).
        """
        req = self.add(req_id, (), tuple(keys), params)
        req.decided = self.steps
        req.phase, req.finished = Phase.RUNNING, self.steps
        while req.phase is not Phase.DONE:
            self.step()
        return req
