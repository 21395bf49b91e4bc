"""One vLLM secondary tier in its own process, driven the way vLLM's scheduler drives it.

Run as ``python tests/vllm_tier_host.py`` (``tests/vllm_interop.py`` does it for
tests). The process hosts ONE tier -- vLLM's own ``P2PSecondaryTierManager`` or
any other ``SecondaryTierManager`` subclass such as
``p2pactor.adapters.vllm:P2PActorTierManager`` -- over a CPU primary region,
with a fake tiering manager around it, so that two such processes exchange
blocks over real ZeroMQ and real NIXL on loopback.

What it builds, as ``TieringOffloadingSpec.get_manager`` would:

* a real ``TieringOffloadingSpec`` over a real ``OffloadingConfig`` (no model,
  no GPU): the fields the P2P tier's compatibility fingerprint reads
  (``FileMapper.from_offloading_spec(..., parallel_agnostic=True)``) come from
  the ``spec`` init options and default to a realistic single-group model;
* the primary KV view: ``memoryview`` of shape ``(num_chunks, chunk_bytes)``
  over a CPU ``torch.uint8`` tensor (how vLLM's ``SharedOffloadRegion`` exposes
  its mmap);
* the tier itself through ``SecondaryTierFactory.create_secondary_tier`` (so
  ``tier_type``, ``backpressure_detector=None`` and the tier kwargs arrive
  exactly as in vLLM);
* :class:`FakeParent`, the ``ParentManager`` handed to
  ``serve_external_requests``: a key -> chunk map plus pending / retry sets,
  pins, job ids from 1000 up, and a checker of vLLM's parent contract;
* the scheduler: per request a ``ReqContext``; an engine step is
  ``get_finished_jobs()`` (vLLM's catch-all poll), ``serve_external_requests``,
  then ``on_schedule_end(ScheduleEndContext(new, ()))``, as in
  ``TieringOffloadingManager.on_schedule_end``. Like vLLM's tier-poll thread
  (``tier_poll_interval_s``, 1 ms by default), a thread also runs
  ``get_finished_jobs()`` + ``serve_external_requests`` between commands for a
  tier that sets ``tolerates_off_thread_polling``; every tier call, from either
  thread, holds one lock.

Why a fake tiering manager and parent, not vLLM's stack: the interop and
cross-host tests make the parent answer HIT_PENDING or RETRY for chosen keys
(``mark_pending``, ``mark_retry``) and check vLLM's parent contract call by
call; vLLM's own manager can do neither. The same pairs inside vLLM's own
stack are in ``tests/test_vllm_stack.py`` (``test_a_mixed_pair_on_vllms_stack``),
and between real engines in ``tests/test_vllm_real.py``.

Protocol. Each line on stdin is one JSON object ``{"cmd": NAME, "id": ANY,
...args}``; each gets exactly one answer line on stdout::

    @host {"id": ..., "ok": true, "result": ...}
    @host {"id": ..., "ok": false, "kind": "...", "error": "...", "traceback": "..."}

Readers ignore every stdout line without the ``@host`` prefix. (The host moves
its own file descriptor 1 onto stderr at start, so vLLM, NIXL and UCX logs go
to stderr; answers use a private duplicate of the original stdout.) Keys travel
as hex strings of the raw ``OffloadKey`` bytes. Times are seconds.

The first command must be ``init``::

    {"cmd": "init",
     "tier": "p2p" | "module.path:ClassName",   # registered type, or out of tree
     "kwargs": {"host": "127.0.0.1", "port": 5710, ...},   # the tier's own config
     "num_chunks": 64, "chunk_bytes": 65536,
     "hash_seed": "0" | null,      # PYTHONHASHSEED for this process; null unsets it
     "hash_algo": "sha256",        # vLLM's prefix_caching_hash_algo (init_none_hash)
     "poll_interval_s": 0.001,     # the tier-poll thread; 0 turns it off
     "log_level": "INFO",          # of the vllm and p2pactor loggers (to stderr)
     "spec": {"model": ..., "dtype": ..., "num_layers": ..., "tokens_per_block": ...,
              "blocks_per_chunk": ..., "data_parallel_index": ...}}   # all optional

and answers ``{"local_id", "tier_class", "tier_type", "hash_seed", "config_fields",
"fingerprint", "base_addr", "poll_thread", "nixl_agent", "import_s", ...}``
(``hash_seed`` is what vLLM's ``get_none_hash_seed()`` resolved; ``fingerprint``
is vLLM's definition over ``config_fields``; ``nixl_agent`` whether vLLM's own
tier built a NIXL agent, null for other tiers). An unimportable tier class
answers ``ok: false`` with ``kind: "tier_import"``.

Engine side (the scheduler and the tiering manager, as vLLM runs them):

* ``new_request(req, params=None)``: ``tier.on_new_request(ReqContext(req, params))``
  -> the policy's value; ``req`` is listed in the next step's ``new_req_ids``.
* ``lookup(req, keys)`` -> ``tier.lookup`` per key: ``["HIT" | "MISS" | "RETRY" | ...]``.
* ``lookup_until(req, keys, timeout=10, sleep_s=0.001)``: lookup, then one engine
  step, until no key answers RETRY -> ``{"results", "elapsed_s", "steps"}``.
* ``submit_load(req, keys)``: allocates free chunks (filled with 0xEE), then
  ``tier.submit_load(TransferJob(id, keys, chunk_ids, is_promotion=True, ctx))``
  -> ``{"job_id", "chunks"}``. On success the keys are committed to the map.
* ``submit_store(req, keys)``: pins the keys' chunks (as vLLM's cascade does with
  ``create_store_job``), then ``tier.submit_store(job)`` -> ``{"job_id", "chunks"}``.
  The pin is released when the tier reports the job (``complete_read``).
* ``finish(req)``: ``tier.on_request_finished(ctx)``.
* ``step(n=1, sleep_s=0.001)``: n engine steps, sleeping between them ->
  ``{"finished": [job results not returned before]}``.
* ``finished()``: those job results, without stepping.
* ``wait_jobs(job_ids, timeout=10)``: steps until every job is reported ->
  ``{"results": {id: result}, "elapsed_s"}`` (``kind: "timeout"`` if not).
* ``has_pending_work()``, ``shutdown()`` (stops the poll thread, then
  ``tier.shutdown()``; the process stays up for reports), ``exit()`` (exits now;
  end of input does the same after a best-effort shutdown), ``info()``, ``ping()``,
  ``clock()`` (the host's time now, as ``calls`` records it; ``info``'s
  ``clock_origin`` is its zero on ``time.monotonic``, which every process of a
  machine shares).

Cache side (this engine's primary tier, as the parent sees it):

* ``store(keys)``: writes each key's deterministic contents
  (``random.Random(key).randbytes(chunk_bytes)``) into a free chunk -> HIT.
* ``mark_pending(keys)`` -> HIT_PENDING, ``mark_retry(keys)`` -> RETRY,
  ``evict(keys)`` -> the keys evicted (nothing is, if any is pinned).
* ``read(keys)`` -> sha256 hex of each key's chunk (null if absent);
  ``verify(keys)`` -> whether each chunk holds the key's expected bytes.
* ``load_state(job_id, exact=false)``: how far a load's writes have got in this
  engine's memory, read without stepping (to catch a transfer mid-way) ->
  ``{"chunks", "touched", "exact", "result"}``: ``touched`` counts the load's
  chunks where any sampled byte (every 4096th, and the last) is no longer the
  0xEE fill; with ``exact``, ``exact`` counts those holding the key's full
  expected bytes (else null); ``result`` is the job's result once reported.

Checks:

* ``parent_report(calls=false)``: ``violations`` (contract breaches, see
  :class:`FakeParent`), ``errors`` (exceptions from the poll thread),
  ``open_ctxs`` (synthetic contexts opened and not finished),
  ``unreleased_jobs`` (pins not yet reported back), ``inflight_loads``,
  ``pinned_keys``, counters, and with ``calls`` every parent call in order.
* ``calls(since=0)``: the parent calls from index ``since`` on, each
  ``{"t", "method", "req", "thread", "keys"?, "result"?, "job_id"?}`` (``t`` in
  seconds since the host started, ``thread`` "main" or "poll").
* ``wait_quiet(timeout=10)``: steps until no context is open, no pin is held
  and no load is in flight -> the report, with ``quiet``.
* ``producer_events(kv_request_id)``: for a tier with a p2pactor node, the
  node's producer events for that request, oldest first: ``[{"kind", "at",
  "lookup_id"?, "deadline"?, "keys"?}]`` (``at`` and ``deadline`` on the node's
  own clock); null for a tier without one.
* ``closed_sessions()``: for a tier with a p2pactor node (``tier.node``), what
  each session that has closed left behind, oldest first: ``[{"peer_id",
  "reason", "failed_loads", "failed_requests", "held_pins", "open_contexts"}]``;
  null for a tier without one (vLLM's own tier only logs why a session ended).
* ``selftest()``: runs a scratch :class:`FakeParent` through deliberate contract
  breaches and returns its report (to check the checker).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

START = time.monotonic()
PREFIX = "@host "


def _claim_stdout() -> TextIO:
    """A private channel for answers; fd 1 (logs of vLLM, NIXL, UCX) goes to stderr."""
    sys.stdout.flush()
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(proto_fd, "w", encoding="utf-8", buffering=1)


PROTO = _claim_stdout()
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
logging.basicConfig(
    stream=sys.stderr,
    level=logging.WARNING,
    format="%(asctime)s.%(msecs)03d %(levelname)s %(threadName)s %(name)s: %(message)s",
    datefmt="%H:%M:%S",
)

# vLLM first: vllm.distributed.nixl_utils sets UCX variables before NIXL loads.
import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_none_hash_seed, init_none_hash  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402
from vllm.v1.kv_offload.tiering.base import (  # noqa: E402
    JobResult,
    ParentManager,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

IMPORTED_AT = time.monotonic()
FIRST_JOB_ID = 1000
LOAD_FILL = 0xEE


class CommandError(Exception):
    """A command the host refuses; ``kind`` tells the client which."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def now() -> float:
    return round(time.monotonic() - START, 6)


def contents(key: bytes, chunk_bytes: int) -> bytes:
    """The deterministic bytes of a stored key's chunk."""
    return random.Random(key).randbytes(chunk_bytes)


def hx(keys: Iterable[bytes]) -> list[str]:
    return [bytes(k).hex() for k in keys]


def unhex(keys: Iterable[str]) -> list[OffloadKey]:
    return [OffloadKey(bytes.fromhex(k)) for k in keys]


@dataclass
class Job:
    """A job the tier holds: a pin (lookup hit or store) or a load into fresh chunks."""

    job_id: int
    kind: str  # "pin" (create_store_job from a serve), "store" (submit_store), "load"
    keys: list[bytes]
    chunks: list[int]
    req_id: str
    created_at: float
    result: dict[str, Any] | None = None


@dataclass
class FakeParent(ParentManager):
    """The tiering manager as a secondary tier sees it, with a contract checker.

    It owns this engine's primary region (a key -> chunk map over ``array``),
    the pending / retry sets, the pins and the job table. Tier-facing methods
    are vLLM's ``ParentManager``; they check vLLM's contract and record every
    call. Violations recorded:

    * any parent call outside ``serve_external_requests`` (the handle was kept);
    * ``on_new_request`` for a context already open;
    * ``lookup`` / ``create_store_job`` for a context not open;
    * ``on_request_finished`` for a context not open (never opened, or twice);
    * ``create_store_job`` naming a key that is not a HIT (nothing to pin);
    * a job reported finished that is unknown, or reported twice;
    * a load's ``successful_keys`` that are not among its keys.
    """

    array: np.ndarray
    calls: list[dict[str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    chunk_of: dict[bytes, int] = field(default_factory=dict)
    pending: set[bytes] = field(default_factory=set)
    retry: set[bytes] = field(default_factory=set)
    pins: dict[int, int] = field(default_factory=dict)
    reserved: set[int] = field(default_factory=set)
    jobs: dict[int, Job] = field(default_factory=dict)
    open_ctxs: dict[str, float] = field(default_factory=dict)
    closed_ctxs: set[str] = field(default_factory=set)
    ctxs_opened: int = 0
    ctxs_finished: int = 0
    serving: bool = False
    thread_name: str = "main"
    next_job_id: int = FIRST_JOB_ID
    unreported: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_chunks(self) -> int:
        return int(self.array.shape[0])

    @property
    def chunk_bytes(self) -> int:
        return int(self.array.shape[1])

    # -- the ParentManager contract -----------------------------------------

    def _record(self, method: str, ctx: ReqContext, **extra: Any) -> dict[str, Any]:
        entry = {"t": now(), "method": method, "req": ctx.req_id, "thread": self.thread_name}
        entry.update(extra)
        self.calls.append(entry)
        if not self.serving:
            self.violations.append(f"{method}({ctx.req_id}) called outside serve_external_requests")
        return entry

    def _check_open(self, method: str, ctx: ReqContext) -> None:
        if ctx.req_id not in self.open_ctxs:
            state = "after on_request_finished" if ctx.req_id in self.closed_ctxs else "unopened"
            self.violations.append(f"{method} on {state} context {ctx.req_id}")

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._record("on_new_request", req_context)
        if req_context.req_id in self.open_ctxs:
            self.violations.append(f"on_new_request twice for open context {req_context.req_id}")
        self.open_ctxs[req_context.req_id] = now()
        self.closed_ctxs.discard(req_context.req_id)
        self.ctxs_opened += 1
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = self.lookup_local(bytes(key))
        self._record("lookup", req_context, keys=hx([key]), result=result.name)
        self._check_open("lookup", req_context)
        return result

    def create_store_job(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> TransferJob:
        wanted = [bytes(k) for k in keys]
        entry = self._record("create_store_job", req_context, keys=hx(wanted))
        self._check_open("create_store_job", req_context)
        missing = [k for k in wanted if k not in self.chunk_of]
        if missing:
            self.violations.append(
                f"create_store_job({req_context.req_id}) for keys that are no HIT: {hx(missing)}"
            )
        job = self.pin(wanted, req_context, "pin")
        entry["job_id"] = job.job_id
        return job

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._record("on_request_finished", req_context)
        if req_context.req_id in self.open_ctxs:
            del self.open_ctxs[req_context.req_id]
            self.closed_ctxs.add(req_context.req_id)
            self.ctxs_finished += 1
        elif req_context.req_id in self.closed_ctxs:
            self.violations.append(f"on_request_finished twice for {req_context.req_id}")
        else:
            self.violations.append(f"on_request_finished for unopened {req_context.req_id}")

    # -- the primary tier --------------------------------------------------------

    def lookup_local(self, key: bytes) -> LookupResult:
        if key in self.chunk_of:
            return LookupResult.HIT
        if key in self.pending:
            return LookupResult.HIT_PENDING
        if key in self.retry:
            return LookupResult.RETRY
        return LookupResult.MISS

    def _allocate(self, n: int) -> list[int]:
        used = set(self.chunk_of.values()) | self.reserved | {c for c, p in self.pins.items() if p}
        free = [c for c in range(self.num_chunks) if c not in used][:n]
        if len(free) < n:
            raise CommandError("full", f"{n} chunks wanted, {len(free)} free")
        return free

    def store(self, keys: list[bytes]) -> list[int]:
        chunks = []
        for key in keys:
            chunk = self.chunk_of.get(key)
            if chunk is None:
                chunk = self._allocate(1)[0]
                self.chunk_of[key] = chunk
            self.array[chunk] = np.frombuffer(contents(key, self.chunk_bytes), dtype=np.uint8)
            self.pending.discard(key)
            self.retry.discard(key)
            chunks.append(chunk)
        return chunks

    def evict(self, keys: list[bytes]) -> list[str]:
        present = [k for k in keys if k in self.chunk_of]
        pinned = [k for k in present if self.pins.get(self.chunk_of[k])]
        if pinned:
            raise CommandError("pinned", f"keys are pinned: {hx(pinned)}")
        for key in present:
            del self.chunk_of[key]
        return hx(present)

    def digest(self, key: bytes) -> str | None:
        chunk = self.chunk_of.get(key)
        if chunk is None:
            return None
        return hashlib.sha256(self.array[chunk].tobytes()).hexdigest()

    # -- jobs ----------------------------------------------------------------------

    def _new_job(self, kind: str, keys: list[bytes], chunks: list[int], ctx: ReqContext) -> Job:
        job = Job(self.next_job_id, kind, keys, chunks, ctx.req_id, now())
        self.next_job_id += 1
        self.jobs[job.job_id] = job
        return job

    def pin(self, keys: list[bytes], ctx: ReqContext, kind: str) -> TransferJob:
        """``create_store_job``: pin the keys' chunks (``prepare_read``) under a new job."""
        chunks = [self.chunk_of[k] for k in keys if k in self.chunk_of]
        for c in chunks:
            self.pins[c] = self.pins.get(c, 0) + 1
        job = self._new_job(kind, keys, chunks, ctx)
        return TransferJob(
            job_id=job.job_id,
            keys=[OffloadKey(k) for k in keys],
            chunk_ids=np.array(chunks, dtype=np.int32),
            is_promotion=False,
            req_context=ctx,
        )

    def prepare_load(self, keys: list[bytes], ctx: ReqContext) -> TransferJob:
        """A promotion: fresh chunks (filled with 0xEE) for the tier to write into."""
        chunks = self._allocate(len(keys))
        for c in chunks:
            self.array[c] = LOAD_FILL
            self.reserved.add(c)
        job = self._new_job("load", keys, chunks, ctx)
        return TransferJob(
            job_id=job.job_id,
            keys=[OffloadKey(k) for k in keys],
            chunk_ids=np.array(chunks, dtype=np.int32),
            is_promotion=True,
            req_context=ctx,
        )

    def complete(self, results: Iterable[JobResult]) -> None:
        """What ``_process_finished_jobs`` does with a tier's finished jobs."""
        for r in results:
            job = self.jobs.get(r.job_id)
            if job is None:
                self.violations.append(f"tier reported unknown job {r.job_id}")
                continue
            if job.result is not None:
                self.violations.append(f"job {r.job_id} reported finished twice")
                continue
            ok_keys = None if r.successful_keys is None else [bytes(k) for k in r.successful_keys]
            job.result = {
                "job_id": job.job_id,
                "kind": job.kind,
                "req": job.req_id,
                "success": bool(r.success),
                "successful_keys": None if ok_keys is None else hx(ok_keys),
                "keys": hx(job.keys),
                "t": now(),
                "after_s": round(now() - job.created_at, 6),
            }
            self.unreported.append(job.result)
            if job.kind == "load":
                self._commit_load(job, r.success, ok_keys)
            else:  # complete_read: unpin, success or not
                for c in job.chunks:
                    self.pins[c] -= 1

    def _commit_load(self, job: Job, success: bool, ok_keys: list[bytes] | None) -> None:
        if success:
            done = set(job.keys)
        else:
            done = set(ok_keys or ())
            stray = done - set(job.keys)
            if stray:
                self.violations.append(f"load {job.job_id} reports foreign keys {hx(stray)}")
                done -= stray
        for key, chunk in zip(job.keys, job.chunks, strict=True):
            self.reserved.discard(chunk)
            if key in done and key not in self.chunk_of:
                self.chunk_of[key] = chunk
                self.pending.discard(key)
                self.retry.discard(key)

    def report(self, *, calls: bool = False) -> dict[str, Any]:
        unreleased = [j for j in self.jobs.values() if j.kind != "load" and j.result is None]
        loads = [j for j in self.jobs.values() if j.kind == "load" and j.result is None]
        key_of = {c: k for k, c in self.chunk_of.items()}
        out: dict[str, Any] = {
            "violations": list(self.violations),
            "open_ctxs": sorted(self.open_ctxs),
            "ctxs_opened": self.ctxs_opened,
            "ctxs_finished": self.ctxs_finished,
            "unreleased_jobs": [
                {"job_id": j.job_id, "kind": j.kind, "req": j.req_id, "keys": hx(j.keys)}
                for j in unreleased
            ],
            "inflight_loads": [
                {"job_id": j.job_id, "req": j.req_id, "keys": hx(j.keys)} for j in loads
            ],
            "pinned_keys": sorted(
                key_of[c].hex() for c, p in self.pins.items() if p and c in key_of
            ),
            "pins": sum(p for p in self.pins.values() if p),
            "jobs": len(self.jobs),
            "stored_keys": len(self.chunk_of),
            "num_calls": len(self.calls),
        }
        if calls:
            out["calls"] = list(self.calls)
        return out

    @property
    def quiet(self) -> bool:
        busy = any(j.result is None for j in self.jobs.values())
        return not self.open_ctxs and not busy


def build_spec(
    options: dict[str, Any], num_chunks: int, chunk_bytes: int, tier_config: dict[str, Any]
) -> TieringOffloadingSpec:
    """A real ``TieringOffloadingSpec`` for a single-group model, without model or GPU."""
    model = options.get("model", "Qwen/Qwen3-0.6B")
    num_layers = int(options.get("num_layers", 28))
    tokens_per_block = int(options.get("tokens_per_block", 16))
    blocks_per_chunk = int(options.get("blocks_per_chunk", 1))
    tp_size = int(options.get("tp_size", 1))
    if chunk_bytes % blocks_per_chunk:
        raise CommandError("config", "chunk_bytes must be a multiple of blocks_per_chunk")
    config = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=tokens_per_block,
                layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(num_layers)),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=chunk_bytes // blocks_per_chunk // tp_size,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": num_chunks * chunk_bytes,
            "blocks_per_chunk": blocks_per_chunk,
            "secondary_tiers": [tier_config],
        },
        engine_id=str(options.get("engine_id", f"interop-{os.getpid()}")),
        model=OffloadingModelConfig(
            name=model,
            dtype=str(options.get("dtype", "bfloat16")),
            max_model_len=int(options.get("max_model_len", 40960)),
        ),
        cache=OffloadingCacheConfig(
            tokens_per_hash=int(options.get("tokens_per_hash", tokens_per_block)),
            blocks_per_chunk=blocks_per_chunk,
        ),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=int(options.get("data_parallel_index", 0)),
            data_parallel_size=int(options.get("data_parallel_size", 1)),
            data_parallel_rank_local=None,
            is_parallelism_agnostic=bool(options.get("is_parallelism_agnostic", True)),
        ),
    )
    return TieringOffloadingSpec(config)


def fingerprint(fields: dict[str, Any]) -> str:
    """The fingerprint the P2P tier advertises for these fields (vLLM's definition)."""
    if not fields:
        return ""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Host:
    """The tier, its fake parent, the scheduler state, and the tier-poll thread."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.steps = 0
        self.poll_rounds = 0
        self.requests: dict[str, ReqContext] = {}
        self.finished_reqs: set[str] = set()
        self.new_req_ids: list[str] = []
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self.shut_down = False

        level = str(args.get("log_level", "INFO")).upper()
        for name in ("vllm", "p2pactor"):
            logging.getLogger(name).setLevel(level)

        seed = args.get("hash_seed")
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = str(seed)
        init_none_hash(get_hash_fn_by_name(str(args.get("hash_algo", "sha256"))))

        num_chunks = int(args.get("num_chunks", 64))
        chunk_bytes = int(args.get("chunk_bytes", 65536))
        tier = str(args.get("tier", "p2p"))
        kwargs = dict(args.get("kwargs") or {})
        if ":" in tier:
            module_path, _, class_name = tier.partition(":")
            tier_config = {"type": class_name, "module_path": module_path, **kwargs}
        else:
            tier_config = {"type": tier, **kwargs}
        try:
            SecondaryTierFactory.get_tier_class(tier_config)
        except (ImportError, AttributeError, ValueError, AssertionError) as exc:
            raise CommandError("tier_import", f"{tier}: {type(exc).__name__}: {exc}") from exc

        self.tensor = torch.zeros((num_chunks, chunk_bytes), dtype=torch.uint8)
        array = self.tensor.numpy()
        self.view = memoryview(array)
        self.parent = FakeParent(array)
        self.spec = build_spec(dict(args.get("spec") or {}), num_chunks, chunk_bytes, tier_config)
        self.config_fields = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=self.spec,
            blocks_per_file=self.spec.blocks_per_chunk,
            parallel_agnostic=True,
        ).get_run_config()
        started = time.monotonic()
        self.tier: SecondaryTierManager = SecondaryTierFactory.create_secondary_tier(
            dict(tier_config), self.view, self.spec
        )
        self.tier_init_s = time.monotonic() - started
        self.kwargs = kwargs
        self.poll_interval_s = float(args.get("poll_interval_s", 0.001))
        if self.poll_interval_s > 0 and type(self.tier).tolerates_off_thread_polling:
            self._poller = threading.Thread(target=self._poll_loop, name="tier-poll", daemon=True)
            self._poller.start()

    # -- driving the tier --------------------------------------------------------

    def _serve(self) -> None:
        self.parent.complete(self.tier.get_finished_jobs())
        self.parent.serving = True
        try:
            self.tier.serve_external_requests(self.parent)
        finally:
            self.parent.serving = False

    def engine_step(self) -> None:
        """One ``TieringOffloadingManager.on_schedule_end``; the caller holds the lock."""
        self.parent.thread_name = "main"
        self._serve()
        new, self.new_req_ids = self.new_req_ids, []
        self.tier.on_schedule_end(ScheduleEndContext(new_req_ids=new, preempted_req_ids=()))
        self.steps += 1

    def _poll_loop(self) -> None:
        """vLLM's tier-poll thread: finished jobs plus serves, between steps."""
        while not self._stop.is_set():
            if self.lock.acquire(timeout=1.0):
                try:
                    if self._stop.is_set():
                        return
                    self.parent.thread_name = "poll"
                    self._serve()
                    self.poll_rounds += 1
                except Exception:
                    self.errors.append(traceback.format_exc())
                finally:
                    self.parent.thread_name = "main"
                    self.lock.release()
            time.sleep(self.poll_interval_s)

    def stop_polling(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)

    def ctx(self, req: str) -> ReqContext:
        ctx = self.requests.get(req)
        if ctx is None:
            raise CommandError("usage", f"unknown request {req!r}")
        if req in self.finished_reqs:
            raise CommandError("usage", f"request {req!r} is finished")
        return ctx

    def _steps_until(
        self, done: Callable[[], Any], timeout: float, sleep_s: float
    ) -> tuple[Any, float, int]:
        """Step until ``done()`` (called under the lock) is truthy."""
        start = time.monotonic()
        steps = 0
        while True:
            with self.lock:
                value = done()
                if value:
                    return value, time.monotonic() - start, steps
                if time.monotonic() - start > timeout:
                    raise CommandError("timeout", f"not done after {timeout}s ({steps} steps)")
                self.engine_step()
            steps += 1
            time.sleep(sleep_s)

    def _take_finished(self) -> list[dict[str, Any]]:
        out, self.parent.unreported = self.parent.unreported, []
        return out

    # -- commands ----------------------------------------------------------------------

    def cmd_info(self) -> dict[str, Any]:
        tier = type(self.tier)
        host = self.kwargs.get("host", os.environ.get("VLLM_P2P_SIDE_CHANNEL_HOST", "localhost"))
        port = self.kwargs.get("port", os.environ.get("VLLM_P2P_SIDE_CHANNEL_PORT", "5710"))
        port = int(port) + self.spec.config.parallel.data_parallel_index
        return {
            "pid": os.getpid(),
            "local_id": f"{host}:{port}",
            "tier_class": f"{tier.__module__}:{tier.__qualname__}",
            "tier_type": self.tier.tier_type,
            "tolerates_off_thread_polling": tier.tolerates_off_thread_polling,
            "poll_thread": self._poller is not None,
            # vLLM's tier only: whether its NixlTransport built an agent.
            "nixl_agent": getattr(getattr(self.tier, "_data", None), "available", None),
            "hash_seed": get_none_hash_seed(),
            "config_fields": self.config_fields,
            "fingerprint": fingerprint(self.config_fields),
            "num_chunks": self.parent.num_chunks,
            "chunk_bytes": self.parent.chunk_bytes,
            "base_addr": int(self.tensor.data_ptr()),
            "import_s": round(IMPORTED_AT - START, 3),
            "tier_init_s": round(self.tier_init_s, 3),
            "steps": self.steps,
            "poll_rounds": self.poll_rounds,
            "clock_origin": START,
        }

    def cmd_ping(self) -> str:
        return "pong"

    def cmd_clock(self) -> float:
        return now()

    def cmd_producer_events(self, kv_request_id: str) -> list[dict[str, Any]] | None:
        node = getattr(self.tier, "node", None)
        if node is None:
            return None
        out = []
        for e in node.event_log.recent():
            actor = e.actor
            if actor.role.name != "PRODUCER" or actor.kv_request_id != kv_request_id:
                continue
            entry: dict[str, Any] = {"kind": e.KIND, "at": e.at}
            for name in ("lookup_id", "deadline"):
                if hasattr(e, name):
                    entry[name] = getattr(e, name)
            if hasattr(e, "keys"):
                entry["keys"] = [bytes(k).hex() for k in e.keys]
            out.append(entry)
        return out

    def cmd_new_request(self, req: str, params: dict[str, Any] | None = None) -> str:
        if req in self.requests:
            raise CommandError("usage", f"request {req!r} already exists")
        ctx = ReqContext(req_id=req, kv_transfer_params=params)
        with self.lock:
            policy = self.tier.on_new_request(ctx)
        self.requests[req] = ctx
        self.new_req_ids.append(req)
        return str(policy.policy.value)

    def cmd_lookup(self, req: str, keys: list[str]) -> list[str]:
        ctx = self.ctx(req)
        with self.lock:
            return [self.tier.lookup(k, ctx).name for k in unhex(keys)]

    def cmd_lookup_until(
        self, req: str, keys: list[str], timeout: float = 10.0, sleep_s: float = 0.001
    ) -> dict[str, Any]:
        ctx = self.ctx(req)
        wanted = unhex(keys)

        def settled() -> list[str] | None:
            names = [self.tier.lookup(k, ctx).name for k in wanted]
            return None if "RETRY" in names else names

        names, elapsed, steps = self._steps_until(settled, timeout, sleep_s)
        return {"results": names, "elapsed_s": round(elapsed, 6), "steps": steps}

    def cmd_submit_load(self, req: str, keys: list[str]) -> dict[str, Any]:
        ctx = self.ctx(req)
        with self.lock:
            job = self.parent.prepare_load([bytes(k) for k in unhex(keys)], ctx)
            self.tier.submit_load(job)
        return {"job_id": job.job_id, "chunks": job.chunk_ids.tolist()}

    def cmd_submit_store(self, req: str, keys: list[str]) -> dict[str, Any]:
        ctx = self.ctx(req)
        wanted = [bytes(k) for k in unhex(keys)]
        missing = [k for k in wanted if k not in self.parent.chunk_of]
        if missing:
            raise CommandError("usage", f"submit_store of keys not stored: {hx(missing)}")
        with self.lock:
            job = self.parent.pin(wanted, ctx, "store")
            self.tier.submit_store(job)
        return {"job_id": job.job_id, "chunks": job.chunk_ids.tolist()}

    def cmd_finish(self, req: str) -> None:
        ctx = self.ctx(req)
        with self.lock:
            self.tier.on_request_finished(ctx)
        self.finished_reqs.add(req)

    def cmd_step(self, n: int = 1, sleep_s: float = 0.001) -> dict[str, Any]:
        for i in range(n):
            with self.lock:
                self.engine_step()
            if sleep_s > 0 and i < n - 1:
                time.sleep(sleep_s)
        with self.lock:
            return {"finished": self._take_finished(), "steps": self.steps}

    def cmd_finished(self) -> list[dict[str, Any]]:
        with self.lock:
            return self._take_finished()

    def cmd_wait_jobs(
        self, job_ids: list[int], timeout: float = 10.0, sleep_s: float = 0.001
    ) -> dict[str, Any]:
        unknown = [j for j in job_ids if j not in self.parent.jobs]
        if unknown:
            raise CommandError("usage", f"unknown jobs {unknown}")

        def done() -> bool:
            return all(self.parent.jobs[j].result is not None for j in job_ids)

        _, elapsed, steps = self._steps_until(done, timeout, sleep_s)
        results = {str(j): self.parent.jobs[j].result for j in job_ids}
        return {"results": results, "elapsed_s": round(elapsed, 6), "steps": steps}

    def cmd_has_pending_work(self) -> bool:
        with self.lock:
            return bool(self.tier.has_pending_work())

    def cmd_store(self, keys: list[str]) -> list[int]:
        with self.lock:
            return self.parent.store([bytes(k) for k in unhex(keys)])

    def cmd_mark_pending(self, keys: list[str]) -> None:
        with self.lock:
            self.parent.pending.update(bytes(k) for k in unhex(keys))

    def cmd_mark_retry(self, keys: list[str]) -> None:
        with self.lock:
            self.parent.retry.update(bytes(k) for k in unhex(keys))

    def cmd_evict(self, keys: list[str]) -> list[str]:
        with self.lock:
            return self.parent.evict([bytes(k) for k in unhex(keys)])

    def cmd_read(self, keys: list[str]) -> list[str | None]:
        with self.lock:
            return [self.parent.digest(bytes(k)) for k in unhex(keys)]

    def cmd_verify(self, keys: list[str]) -> list[bool]:
        out = []
        with self.lock:
            for k in unhex(keys):
                chunk = self.parent.chunk_of.get(bytes(k))
                ok = chunk is not None and self.parent.array[chunk].tobytes() == contents(
                    bytes(k), self.parent.chunk_bytes
                )
                out.append(ok)
        return out

    def cmd_load_state(self, job_id: int, exact: bool = False) -> dict[str, Any]:
        with self.lock:
            job = self.parent.jobs.get(job_id)
            if job is None or job.kind != "load":
                raise CommandError("usage", f"no load job {job_id}")
            result = job.result
        array = self.parent.array
        chunks = np.asarray(job.chunks, dtype=np.int64)
        step = max(1, min(4096, self.parent.chunk_bytes))
        samples = np.concatenate([array[chunks, ::step], array[chunks, -1:]], axis=1)
        touched = int(np.any(samples != LOAD_FILL, axis=1).sum())
        full = None
        if exact:
            full = sum(
                array[c].tobytes() == contents(k, self.parent.chunk_bytes)
                for k, c in zip(job.keys, job.chunks, strict=True)
            )
        return {"chunks": len(job.chunks), "touched": touched, "exact": full, "result": result}

    def cmd_closed_sessions(self) -> list[dict[str, Any]] | None:
        node = getattr(self.tier, "node", None)
        closed = getattr(node, "closed_sessions", None)
        if closed is None:
            return None
        out = []
        for r in closed():
            entry: dict[str, Any] = {"peer_id": str(r.peer_id), "reason": str(r.reason)}
            for name in ("failed_loads", "failed_requests", "held_pins", "open_contexts"):
                entry[name] = list(getattr(r, name, ()))
            out.append(entry)
        return out

    def cmd_parent_report(self, calls: bool = False) -> dict[str, Any]:
        with self.lock:
            report = self.parent.report(calls=calls)
        report["errors"] = list(self.errors)
        return report

    def cmd_wait_quiet(self, timeout: float = 10.0, sleep_s: float = 0.001) -> dict[str, Any]:
        start = time.monotonic()
        try:
            _, elapsed, _ = self._steps_until(lambda: self.parent.quiet, timeout, sleep_s)
            quiet = True
        except CommandError:
            elapsed, quiet = time.monotonic() - start, False
        report = self.cmd_parent_report()
        report.update(quiet=quiet, elapsed_s=round(elapsed, 6))
        return report

    def cmd_calls(self, since: int = 0) -> list[dict[str, Any]]:
        with self.lock:
            return self.parent.calls[since:]

    def cmd_shutdown(self) -> dict[str, Any]:
        self.stop_polling()
        with self.lock:
            if not self.shut_down:
                self.shut_down = True
                self.tier.shutdown()
        return self.cmd_parent_report()

    def cmd_selftest(self) -> dict[str, Any]:
        """Breach the contract on a scratch parent; the report must list every breach."""
        scratch = FakeParent(np.zeros((4, 64), dtype=np.uint8))
        a, b = ReqContext("a"), ReqContext("b")
        key, other = OffloadKey(b"k" * 36), OffloadKey(b"o" * 36)
        scratch.store([key])
        scratch.lookup(key, a)  # outside a serve; context not open
        scratch.serving = True
        scratch.on_new_request(a)
        scratch.on_new_request(a)  # twice
        job = scratch.create_store_job([key, other], a)  # other is no HIT
        scratch.on_request_finished(a)
        scratch.on_request_finished(a)  # twice
        scratch.on_request_finished(b)  # never opened
        scratch.lookup(key, a)  # after finish
        scratch.on_new_request(b)  # left open
        scratch.serving = False
        scratch.complete([JobResult(job.job_id, success=True)])
        scratch.complete([JobResult(job.job_id, success=True), JobResult(99, success=True)])
        return scratch.report(calls=True)


def handle(host: Host | None, msg: dict[str, Any]) -> tuple[Host | None, Any]:
    cmd = msg.pop("cmd", None)
    msg.pop("id", None)
    if cmd == "init":
        if host is not None:
            raise CommandError("usage", "init twice")
        host = Host(msg)
        return host, host.cmd_info()
    if host is None:
        raise CommandError("usage", f"{cmd!r} before init")
    method = getattr(host, f"cmd_{cmd}", None)
    if method is None:
        raise CommandError("usage", f"unknown command {cmd!r}")
    return host, method(**msg)


def answer(obj: dict[str, Any]) -> None:
    PROTO.write(PREFIX + json.dumps(obj, separators=(",", ":")) + "\n")
    PROTO.flush()


def main() -> None:
    host: Host | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        msg_id = None
        try:
            msg = json.loads(line)
            msg_id = msg.get("id")
            if msg.get("cmd") == "exit":
                answer({"id": msg_id, "ok": True, "result": None})
                os._exit(0)
            host, result = handle(host, msg)
            answer({"id": msg_id, "ok": True, "result": result})
        except CommandError as exc:
            answer({"id": msg_id, "ok": False, "kind": exc.kind, "error": str(exc)})
        except Exception as exc:
            answer(
                {
                    "id": msg_id,
                    "ok": False,
                    "kind": type(exc).__name__,
                    "error": str(exc),
                    "traceback": traceback.format_exc(),
                }
            )
    # End of input: the test is gone. Shut the tier down if we can, then leave
    # without waiting for NIXL's or ZeroMQ's threads.
    if host is not None:
        with contextlib.suppress(Exception):
            host.cmd_shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
