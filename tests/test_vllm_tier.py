"""vLLM 0.33's secondary-tier contract, against our ``P2PActorTierManager``.

The scenarios are upstream's ``tests/v1/kv_offload/tiering/p2p/test_manager.py``
(vllm-p2p-0.33.md §5) that apply to our tier. Upstream drives its manager with
fake sessions and transports; here real tiers run in this process, each with
its own node thread, real ZeroMQ on 127.0.0.1 and real NIXL between CPU
tensors, and the tests drive them the way vLLM's scheduler does, step by step:
``lookup`` per key while scheduling, then, per tier, ``get_finished_jobs()``,
``serve_external_requests(parent)`` and ``on_schedule_end`` (the order of
``TieringOffloadingManager.on_schedule_end``); loads and stores are submitted
between steps.

:class:`FakeParent` is vLLM's ``ParentManager`` as its contract reads (§3.2):
it records every call in order, refuses lookups and pins outside an open
synthetic request, counts pins per job, allocates job ids from 1000 up, and is
"lent" only during ``serve_external_requests``. Every test ends with
:meth:`Harness.check`, which asserts the contract on every tier: each synthetic
request opened was finished exactly once, each job (pin, store, load) was
reported by ``get_finished_jobs()`` exactly once, no pin is left, and every
tier is idle (``has_pending_work()`` false).

Why a parent of our own here, and not vLLM's stack: these tests make the
parent answer HIT_PENDING or RETRY at a chosen moment, submit a job by hand,
and count every call against the contract; vLLM's ``TieringOffloadingManager``
can be made to do none of that, and it would hide a violation (its tier-poll
thread logs an exception and goes on). The same flows run inside vLLM's own
stack, engine to engine, in ``tests/test_vllm_stack.py``, and between real
vLLM engines in ``tests/test_vllm_real.py``.

Where upstream asserts internals (``_failed_req_ids``, ``_kv_to_session``,
calls on a fake session), these tests assert what is observable instead:
answers, job results, parent calls, bytes, sessions and the node's events.
Intentional differences from vLLM's manager are said where they matter:

* ``has_pending_work()`` is true only while something is outstanding (vLLM's
  tier always answers True);
* a synthetic parent request is opened per lookup message and closed once that
  lookup is answered; its pins outlive it until the fetch or the end of the
  request (vLLM keeps the request open until then);
* ``drain_jobs()`` gives up after 30 s (vLLM's only warns);
* ``allowed_peers`` has no vLLM counterpart.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.base",
    reason="vLLM with tiered KV offloading (0.26 or newer) is not installed",
)

import numpy as np
import torch

# The adapter imports these lazily (the seed at the first handshake, the
# fingerprint's FileMapper at construction); importing them first, here, keeps
# torch's import-time DeprecationWarnings out of pytest's "error" filter.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import vllm.v1.kv_offload.file_mapper  # noqa: F401
    from vllm.v1.core import kv_cache_utils
from vllm.utils.hashing import sha256
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ParentManager,
    TransferJob,
)

import p2pactor.adapters._vllm_api as vllm_api
import p2pactor.adapters._vllm_parent as vllm_jobs
import p2pactor.adapters.vllm as adapter
from p2pactor.adapters._vllm_thread import NodeThread
from p2pactor.adapters.nixl import import_nixl
from p2pactor.adapters.vllm import P2PActorTierManager
from p2pactor.errors import DataPlaneError
from p2pactor.runtime.config import NodeConfig
from tests.ports import free_port

try:
    import_nixl()
except DataPlaneError as exc:
    pytest.skip(f"no NIXL wheel imports: {exc}", allow_module_level=True)

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
HIT_PENDING = LookupResult.HIT_PENDING
HOST = "127.0.0.1"
NUM_CHUNKS = 64
CHUNK_BYTES = 1024
TIMEOUT = 60.0  # generous: 2 busy cores, and every wait ends as soon as it can


def offloading_spec(dp_index: int = 0) -> Any:
    """A stand-in OffloadingSpec with what the tier reads (port offset, fingerprint)."""
    parallel = SimpleNamespace(
        data_parallel_index=dp_index,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        rank=0,
        is_parallelism_agnostic=True,
    )
    config = SimpleNamespace(
        parallel=parallel,
        model=SimpleNamespace(name="p2pactor/tiny-test-model", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16),
        groups=[SimpleNamespace(tokens_per_block=16, layer_names=["model.layers.0.attn"])],
        canonical_layout=False,
        kv_cache_layout=None,
        replicated_layout=False,
    )
    return SimpleNamespace(config=config, blocks_per_chunk=1)


_key_counter = itertools.count()


def new_keys(n: int) -> list[bytes]:
    """``n`` fresh OffloadKeys (a block hash, then group 0), unique in this module."""
    return [
        make_offload_key(hashlib.sha256(b"key %d" % next(_key_counter)).digest(), 0)
        for _ in range(n)
    ]


_id_counter = itertools.count()


def new_id(what: str) -> str:
    return f"{what}-{next(_id_counter)}"


def source(role: str, kv_id: str, peer: Engine, **overrides: Any) -> dict[str, Any]:
    """``kv_transfer_params`` naming ``peer`` in ``role`` (a consumer role)."""
    params = {"kv_request_id": kv_id, "remote_host": HOST, "remote_port": peer.port}
    params.update(overrides)
    return {role: {k: v for k, v in params.items() if v is not None}}


def decoder(kv_id: str | None) -> dict[str, Any]:
    """``kv_transfer_params`` of a prefill/decode producer."""
    return {"remote_decoder": {} if kv_id is None else {"kv_request_id": kv_id}}


class ContractViolation(Exception):
    """The tier called the parent in a way vLLM's contract forbids."""


class FakeParent(ParentManager):
    """vLLM's ParentManager for one tier, during one test.

    Attributes:
        stored: Key -> primary chunk; these keys are HITs.
        pending: Keys answered HIT_PENDING; retry: keys answered RETRY.
        calls: Every call, in order: ``(method, req_id)``.
        opened, finished: Synthetic request ids, counted.
        pins: Outstanding pins: job id -> chunks (released when reported).
        expected: Every job that must be reported, with what it is.
        results: Reported jobs, by id; reported: how often each was.
        errors: Contract violations seen.
    """

    def __init__(self, name: str, job_ids: Iterator[int]) -> None:
        self.name = name
        self._job_ids = job_ids
        self.stored: dict[bytes, int] = {}
        self.pending: set[bytes] = set()
        self.retry: set[bytes] = set()
        self.calls: list[tuple[str, str]] = []
        self.lent = False
        self.open: dict[str, ReqContext] = {}
        self.opened: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.pins: dict[int, tuple[int, ...]] = {}
        self.expected: dict[int, str] = {}
        self.results: dict[int, JobResult] = {}
        self.reported: Counter[int] = Counter()
        self.errors: list[str] = []
        self.loads: dict[int, dict[bytes, int]] = {}

    # --- vLLM's ParentManager --------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._enter("on_new_request", req_context)
        if req_context.req_id in self.open:
            self._refuse(f"on_new_request({req_context.req_id}) while it is open")
        self.open[req_context.req_id] = req_context
        self.opened[req_context.req_id] += 1
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        self._enter("lookup", req_context)
        self._require_open("lookup", req_context)
        if key in self.stored:
            return HIT
        if key in self.pending:
            return HIT_PENDING
        if key in self.retry:
            return RETRY
        return MISS

    def create_store_job(self, keys: Collection[Any], req_context: ReqContext) -> TransferJob:
        self._enter("create_store_job", req_context)
        self._require_open("create_store_job", req_context)
        missing = [k for k in keys if k not in self.stored]
        if missing:
            self._refuse(f"create_store_job of {len(missing)} keys that are not stored")
        return self.new_job("pin", keys, [self.stored[k] for k in keys], req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._enter("on_request_finished", req_context)
        if self.open.pop(req_context.req_id, None) is None:
            self._refuse(f"on_request_finished({req_context.req_id}), which is not open")
        self.finished[req_context.req_id] += 1

    # --- the rest of vLLM's manager, as far as the tests need it -----------------

    def new_job(
        self, kind: str, keys: Collection[Any], chunks: Sequence[int], ctx: ReqContext
    ) -> TransferJob:
        """A job of this tier: a pin, a store (pinned too) or a load (a promotion)."""
        job_id = next(self._job_ids)
        self.expected[job_id] = kind
        if kind != "load":
            self.pins[job_id] = tuple(chunks)
        else:
            self.loads[job_id] = dict(zip(keys, chunks, strict=True))
        return TransferJob(
            job_id=job_id,
            keys=list(keys),
            chunk_ids=np.array(chunks, dtype=np.int64),
            is_promotion=kind == "load",
            req_context=ctx,
        )

    def take(self, results: Any) -> None:
        """What ``get_finished_jobs()`` returned; unpins (vLLM's ``complete_read``).

        A load that succeeded is in the primary now, as after vLLM's promotion.
        """
        for result in results:
            job_id = result.job_id
            self.reported[job_id] += 1
            if self.reported[job_id] > 1:
                self.errors.append(f"job {job_id} reported {self.reported[job_id]} times")
            if job_id not in self.expected:
                self.errors.append(f"job {job_id} reported, but it is no job of this test")
            self.results[job_id] = result
            self.pins.pop(job_id, None)
            loaded = self.loads.pop(job_id, {})
            if result.success:
                self.stored.update(loaded)  # a promotion completed: the primary holds them

    def settled(self) -> bool:
        return not self.open and not self.pins and set(self.reported) >= set(self.expected)

    def check(self) -> None:
        assert self.errors == [], f"{self.name}: {self.errors}"
        assert self.open == {}, f"{self.name}: synthetic requests never finished"
        assert set(self.finished) == set(self.opened), self.name
        assert all(n == 1 for n in self.opened.values()), self.opened
        assert all(n == 1 for n in self.finished.values()), self.finished
        assert set(self.reported) == set(self.expected), (
            f"{self.name}: jobs {sorted(set(self.expected) - set(self.reported))} never "
            f"reported, {sorted(set(self.reported) - set(self.expected))} unknown"
        )
        assert all(n == 1 for n in self.reported.values()), self.reported
        assert self.pins == {}, f"{self.name}: pins left {self.pins}"

    # --- internals ---------------------------------------------------------------

    def _enter(self, method: str, ctx: ReqContext) -> None:
        self.calls.append((method, ctx.req_id))
        if not self.lent:
            self._refuse(f"{method}({ctx.req_id}) outside serve_external_requests")

    def _require_open(self, method: str, ctx: ReqContext) -> None:
        if ctx.req_id not in self.open:
            self._refuse(f"{method}({ctx.req_id}) outside an open request")

    def _refuse(self, what: str) -> None:
        self.errors.append(what)
        raise ContractViolation(what)


class Engine:
    """One tier, with its primary region, as a vLLM engine would hold it."""

    def __init__(self, name: str, *, port: int | None = None, **tier_kwargs: Any) -> None:
        self.name = name
        self.port = port if port is not None else free_port()
        self.memory = torch.zeros(NUM_CHUNKS, CHUNK_BYTES, dtype=torch.uint8)
        self.tier = P2PActorTierManager(
            offloading_spec(),
            memoryview(self.memory.numpy()),
            host=HOST,
            port=self.port,
            **tier_kwargs,
        )
        self.job_ids = itertools.count(1000)  # one allocator per engine, as in vLLM
        self._chunks = itertools.cycle(range(NUM_CHUNKS))
        self.parent = FakeParent(name, self.job_ids)
        self.shut = False

    @property
    def peer_id(self) -> str:
        return f"{HOST}:{self.port}"

    def chunks(self, n: int) -> list[int]:
        """``n`` primary chunks, zeroed (never more than one test's worth at once)."""
        out = [next(self._chunks) for _ in range(n)]
        self.memory[out] = 0
        return out

    def put(self, keys: Sequence[bytes]) -> list[int]:
        """Store ``keys`` in the primary tier (random bytes): they are HITs from now on."""
        chunks = self.chunks(len(keys))
        for k, c in zip(keys, chunks, strict=True):
            self.memory[c] = torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8)
            self.parent.stored[k] = c
        return chunks

    def sessions(self) -> set[str]:
        return {s.peer_id for s in self.tier.node.peers.sessions()}

    def events(self, kind: str, kv_id: str) -> list[Any]:
        return [
            e
            for e in self.tier.node.event_log.recent()
            if kind == e.KIND and e.actor.kv_request_id == kv_id
        ]

    def shutdown(self) -> None:
        if not self.shut:
            self.shut = True
            self.tier.shutdown()


class Harness:
    """Steps a set of engines like vLLM's scheduler, and checks the parent contract."""

    def __init__(self, *engines: Engine) -> None:
        self.engines: list[Engine] = []
        self.requests: dict[tuple[str, str], tuple[Engine, ReqContext]] = {}
        for engine in engines:
            self.add(engine)

    def add(self, engine: Engine) -> Engine:
        engine.parent = FakeParent(engine.name, engine.job_ids)
        self.engines.append(engine)
        return engine

    def retire(self, engine: Engine) -> None:
        """Check ``engine``'s contract and shut it down."""
        self.check(only=engine)
        self.engines.remove(engine)
        engine.shutdown()

    # --- the engine's calls ------------------------------------------------------

    def open(
        self, engine: Engine, params: dict[str, Any] | None
    ) -> tuple[ReqContext, RequestOffloadingContext]:
        """A new engine request (vLLM's ``add_request``)."""
        ctx = ReqContext(req_id=new_id("req"), kv_transfer_params=params)
        policy = engine.tier.on_new_request(ctx)
        self.requests[engine.name, ctx.req_id] = (engine, ctx)
        return ctx, policy

    def finish(self, engine: Engine, ctx: ReqContext) -> None:
        """The engine request is over (vLLM's ``_maybe_finalize_request``)."""
        del self.requests[engine.name, ctx.req_id]
        engine.tier.on_request_finished(ctx)

    def load(
        self, engine: Engine, ctx: ReqContext, keys: Sequence[bytes], chunks: Sequence[int]
    ) -> int:
        """A promotion of ``keys`` into ``chunks``; returns its job id."""
        job = engine.parent.new_job("load", keys, chunks, ctx)
        engine.tier.submit_load(job)
        return int(job.job_id)

    def store(self, engine: Engine, ctx: ReqContext, keys: Sequence[bytes]) -> int:
        """A cascade of stored ``keys`` to the tier (pinned until reported)."""
        chunks = [engine.parent.stored[k] for k in keys]
        job = engine.parent.new_job("store", keys, chunks, ctx)
        engine.tier.submit_store(job)
        return int(job.job_id)

    # --- steps ---------------------------------------------------------------------

    def step(self, engines: Sequence[Engine] | None = None) -> None:
        for engine in self.engines if engines is None else engines:
            engine.parent.take(engine.tier.get_finished_jobs())
            engine.parent.lent = True
            try:
                engine.tier.serve_external_requests(engine.parent)
            finally:
                engine.parent.lent = False
            engine.tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def steps_until(
        self,
        cond: Callable[[], bool],
        what: str,
        timeout: float = TIMEOUT,
        engines: Sequence[Engine] | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.step(engines)
            time.sleep(0.001)
            if cond():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout:g} s: {what}")

    def lookup_all(
        self, engine: Engine, ctx: ReqContext, keys: Sequence[bytes]
    ) -> list[LookupResult]:
        """Look ``keys`` up every step until none is RETRY, as the scheduler does."""
        answers: list[LookupResult] = []

        def answered() -> bool:
            answers[:] = [engine.tier.lookup(k, ctx) for k in keys]
            return RETRY not in answers

        self.steps_until(answered, f"lookups of {ctx.req_id} answered")
        return answers

    def result(self, engine: Engine, job_id: int, timeout: float = TIMEOUT) -> JobResult:
        self.steps_until(lambda: job_id in engine.parent.results, f"job {job_id} reported", timeout)
        return engine.parent.results[job_id]

    # --- the contract --------------------------------------------------------------

    def settle(self, timeout: float = TIMEOUT, only: Engine | None = None) -> None:
        """Finish the requests still open, then wait until the tiers are settled and idle."""
        engines = self.engines if only is None else [only]
        for engine, ctx in list(self.requests.values()):
            if engine in engines:
                self.finish(engine, ctx)
        self.steps_until(
            lambda: all(e.parent.settled() and not e.tier.has_pending_work() for e in engines),
            "every parent settled and every tier idle",
            timeout,
        )

    def check(self, only: Engine | None = None) -> None:
        """Assert the parent contract on every tier, or ``only`` (and nothing more arrives)."""
        self.settle(only=only)
        for _ in range(20):
            self.step()
            time.sleep(0.001)
        for engine in self.engines if only is None else [only]:
            engine.parent.check()


def _node_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "p2pactor-node"}


def assert_bytes_moved(
    src: Engine, src_chunks: Sequence[int], dst: Engine, dst_chunks: Sequence[int]
) -> None:
    for s, d in zip(src_chunks, dst_chunks, strict=True):
        assert torch.equal(src.memory[s], dst.memory[d]), f"chunk {s} -> {d}"
        assert bool(dst.memory[d].any()), f"chunk {d} is still zero"


def assert_transfer(result: JobResult, *, success: bool, blocks: int, within: float) -> None:
    """``result`` carries what vLLM's tier metrics read: its seconds and its bytes.

    ``blocks`` blocks' bytes if it succeeded, else 0; more than 0 s, and at most
    ``within`` s (the wall time the test saw around the job: no speed is asserted).
    """
    assert result.success is success
    assert result.transfer_bytes == (blocks * CHUNK_BYTES if success else 0)
    assert result.transfer_time is not None
    assert 0 < result.transfer_time <= within, (result.transfer_time, within)


def assert_forgotten(engine: Engine, *job_ids: int) -> None:
    """The tier keeps nothing of ``job_ids`` once it has reported them."""
    tracked = set(engine.tier.jobs.loads) | set(engine.tier.jobs.stores)
    assert tracked.isdisjoint(job_ids), sorted(tracked.intersection(job_ids))


def adapter_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "p2pactor.vllm" and r.levelno >= logging.WARNING]


@contextlib.contextmanager
def vllm_hash_seed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str | None], None]]:
    """Set vLLM's resolved seed as the engine does (``init_none_hash``); restored after."""
    monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", kv_cache_utils._NONE_HASH_SEED)
    monkeypatch.setattr(
        kv_cache_utils, "NONE_HASH", getattr(kv_cache_utils, "NONE_HASH", None), raising=False
    )

    def set_seed(seed: str | None) -> None:
        if seed is None:  # before init_none_hash: vLLM's default
            kv_cache_utils._NONE_HASH_SEED = None
            return
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        kv_cache_utils.init_none_hash(sha256)

    yield set_seed


# --- fixtures --------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Engine, Engine]]:
    """Two tiers for the whole module: each test uses its own request ids and keys."""
    a = Engine("a")
    try:
        b = Engine("b")
    except BaseException:
        a.shutdown()
        raise
    # Resolve both seeds now, before any test changes vLLM's.
    assert a.tier.node.hash_seed == b.tier.node.hash_seed
    yield a, b
    b.shutdown()
    a.shutdown()


@pytest.fixture
def h(pair: tuple[Engine, Engine]) -> Iterator[Harness]:
    harness = Harness(*pair)
    yield harness
    # After a failure, leave the module's tiers quiet for the next test.
    extra = harness.engines[2:]
    with contextlib.suppress(AssertionError):
        harness.settle(timeout=10)
    for engine in extra:
        engine.shutdown()


@pytest.fixture
def a(pair: tuple[Engine, Engine]) -> Engine:
    return pair[0]


@pytest.fixture
def b(pair: tuple[Engine, Engine]) -> Engine:
    return pair[1]


# --- peer ids, lookups, policies -------------------------------------------------


def _no_source_cases(peer_port: int) -> dict[str, dict[str, Any] | None]:
    full = {"kv_request_id": "kv", "remote_host": HOST, "remote_port": peer_port}

    def without(field: str) -> dict[str, Any]:
        return {k: v for k, v in full.items() if k != field}

    return {
        "no params": None,
        "empty params": {},
        "kv_source missing host": {"remote_kv_source": without("remote_host")},
        "kv_source missing port": {"remote_kv_source": without("remote_port")},
        "kv_source missing id": {"remote_kv_source": without("kv_request_id")},
        "kv_source empty host": {"remote_kv_source": {**full, "remote_host": ""}},
        "kv_source empty": {"remote_kv_source": {}},
        "prefiller missing host": {"remote_prefiller": without("remote_host")},
        "prefiller missing port": {"remote_prefiller": without("remote_port")},
        "prefiller missing id": {"remote_prefiller": without("kv_request_id")},
        "only remote_decoder": {"remote_decoder": {"kv_request_id": "kv"}},
        "stray top-level host and port": {"remote_host": HOST, "remote_port": peer_port},
    }


NO_SOURCE_CASES = list(_no_source_cases(0))


@pytest.mark.parametrize("case", NO_SOURCE_CASES)
def test_lookup_without_a_complete_source_is_a_miss_and_dials_nobody(
    h: Harness, a: Engine, b: Engine, case: str
) -> None:
    """Upstream: peer-id parsing (missing host/port/id), no/incomplete params → MISS.

    The source named in the incomplete params is our peer ``b``: it must never
    be asked anything, and no new session may appear.
    """
    params = _no_source_cases(b.port)[case]
    sessions_before = a.sessions()
    ctx, _ = h.open(a, params)
    keys = new_keys(3)
    b.put(keys)
    assert [a.tier.lookup(k, ctx) for k in keys] == [MISS] * 3
    for _ in range(10):
        h.step()
        time.sleep(0.001)
    assert [a.tier.lookup(k, ctx) for k in keys] == [MISS] * 3
    assert a.sessions() <= sessions_before | {b.peer_id}
    assert b.parent.calls == []
    h.check()


def test_lookup_of_a_request_the_tier_never_saw_is_a_miss(h: Harness, a: Engine) -> None:
    ctx = ReqContext(req_id=new_id("unseen"), kv_transfer_params=None)
    assert a.tier.lookup(new_keys(1)[0], ctx) is MISS
    h.check()


@pytest.mark.parametrize("port_as", [int, str])
def test_valid_source_looks_up_on_that_peer(
    h: Harness, a: Engine, b: Engine, port_as: Callable[[int], Any]
) -> None:
    """A valid ``remote_kv_source`` (port as int or as string) probes the peer."""
    keys = new_keys(5)
    b.put(keys[:3])
    kv_id = new_id("kv")
    ctx, _ = h.open(a, source("remote_kv_source", kv_id, b, remote_port=port_as(b.port)))
    assert h.lookup_all(a, ctx, keys) == [HIT, HIT, HIT, MISS, MISS]
    assert b.peer_id in a.sessions()
    h.finish(a, ctx)
    h.check()
    # b served it through a synthetic request of its own, opened and finished once.
    assert [m for m, _ in b.parent.calls][:2] == ["on_new_request", "lookup"]
    assert {m for m, _ in b.parent.calls} == {
        "on_new_request",
        "lookup",
        "create_store_job",
        "on_request_finished",
    }


def test_remote_prefiller_is_a_hit_at_once_with_no_lookup_traffic(
    h: Harness, a: Engine, b: Engine
) -> None:
    """PD decode: every key is a HIT without probing; the prefiller is asked nothing."""
    kv_id = new_id("pd")
    ctx, _ = h.open(a, source("remote_prefiller", kv_id, b))
    keys = new_keys(4)
    assert [a.tier.lookup(k, ctx) for k in keys] == [HIT] * 4
    for _ in range(20):
        h.step()
        time.sleep(0.001)
    assert [a.tier.lookup(k, ctx) for k in keys] == [HIT] * 4
    assert b.parent.calls == []
    assert b.events("LookupReceived", kv_id) == []
    h.finish(a, ctx)
    h.check()


def test_remote_prefiller_wins_over_remote_kv_source(h: Harness, a: Engine, b: Engine) -> None:
    """Both keys present: the prefiller is used, the kv source is never dialed."""
    nowhere = free_port()  # nothing listens there
    kv_id = new_id("pd")
    params = {
        **source("remote_prefiller", kv_id, b),
        "remote_kv_source": {"kv_request_id": "other", "remote_host": HOST, "remote_port": nowhere},
    }
    ctx, _ = h.open(a, params)
    assert a.tier.lookup(new_keys(1)[0], ctx) is HIT
    for _ in range(10):
        h.step()
        time.sleep(0.001)
    assert f"{HOST}:{nowhere}" not in a.sessions()
    assert a.tier.node.peers.session(f"{HOST}:{nowhere}") is None
    assert b.parent.calls == []
    h.finish(a, ctx)
    h.check()


@pytest.mark.parametrize(
    ("role", "policy"),
    [
        ("producer with id", OffloadPolicy.REQUEST_LEVEL),
        ("plain (None)", OffloadPolicy.CHUNK_LEVEL),
        ("plain ({})", OffloadPolicy.CHUNK_LEVEL),
        ("consumer", OffloadPolicy.CHUNK_LEVEL),
        ("PD consumer", OffloadPolicy.CHUNK_LEVEL),
        ("producer without id", OffloadPolicy.CHUNK_LEVEL),
        ("producer with empty id", OffloadPolicy.CHUNK_LEVEL),
    ],
)
def test_on_new_request_policy(
    h: Harness, a: Engine, b: Engine, role: str, policy: OffloadPolicy
) -> None:
    params: dict[str, dict[str, Any] | None] = {
        "producer with id": decoder(new_id("kv")),
        "plain (None)": None,
        "plain ({})": {},
        "consumer": source("remote_kv_source", new_id("kv"), b),
        "PD consumer": source("remote_prefiller", new_id("kv"), b),
        "producer without id": decoder(None),
        "producer with empty id": {"remote_decoder": {"kv_request_id": ""}},
    }
    ctx, answer = h.open(a, params[role])
    assert answer.policy is policy
    h.finish(a, ctx)
    h.check()


# --- the hash seed -----------------------------------------------------------------


def test_hash_seed_is_vllms_resolved_lazily(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed is read from ``get_none_hash_seed()`` on first need, not at construction.

    vLLM builds the tier before ``init_none_hash`` runs; a seed read eagerly would
    be vLLM's default even where PYTHONHASHSEED is set.
    """
    with vllm_hash_seed(monkeypatch) as set_seed:
        set_seed(None)
        default = h.add(Engine("default-seed"))
        lazy = h.add(Engine("lazy-seed"))
        # Only now does the engine resolve its seed (PYTHONHASHSEED wins).
        set_seed("p2pactor-test-seed-lazy")
        assert kv_cache_utils.get_none_hash_seed() == "p2pactor-test-seed-lazy"
        assert lazy.tier.node.hash_seed == "p2pactor-test-seed-lazy"
        set_seed(None)
        assert default.tier.node.hash_seed == kv_cache_utils.DEFAULT_NONE_HASH_SEED
    h.retire(lazy)
    h.retire(default)
    h.check()


def test_peers_with_different_hash_seeds_refuse_each_other(
    h: Harness, b: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handshake fails on the seed: lookups answer MISS and no block moves."""
    with vllm_hash_seed(monkeypatch) as set_seed:
        odd = h.add(Engine("odd-seed"))
        set_seed("p2pactor-test-seed-odd")
        assert odd.tier.node.hash_seed != b.tier.node.hash_seed
    keys = new_keys(3)
    src = b.put(keys)
    kv_id = new_id("kv")
    ctx, _ = h.open(odd, source("remote_kv_source", kv_id, b))
    assert h.lookup_all(odd, ctx, keys) == [MISS] * 3
    job = h.load(odd, ctx, keys, odd.chunks(3))
    assert h.result(odd, job).success is False
    reasons = [r.reason for r in odd.tier.node.peers.closed_sessions() if r.peer_id == b.peer_id]
    # (b's disconnect may arrive after odd's session ended, as a second, stray
    # connection that odd closes too.)
    assert any("hash seed differs" in r for r in reasons), reasons
    assert b.parent.calls == []
    assert not odd.memory.any()
    assert all(bool(b.memory[c].any()) for c in src)
    h.finish(odd, ctx)
    h.retire(odd)
    h.check()


# --- serving the parent ------------------------------------------------------------


def test_serve_external_requests_uses_the_parent_only_during_the_call(
    h: Harness, a: Engine, b: Engine
) -> None:
    """A peer's lookup reaches ``b`` but waits, untouched, until ``b`` lends its parent.

    The FakeParent refuses (and records) any call made while it is not lent.
    """
    keys = new_keys(2)
    b.put(keys)
    kv_id = new_id("kv")
    ctx, _ = h.open(a, source("remote_kv_source", kv_id, b))
    assert [a.tier.lookup(k, ctx) for k in keys] == [RETRY, RETRY]
    # Step only a (its lookups go out); b's engine is busy and lends nothing.
    h.steps_until(
        lambda: bool(b.events("LookupReceived", kv_id)), "b received the lookup", engines=[a]
    )
    time.sleep(0.05)  # b's node thread has all the time it wants
    assert b.parent.calls == []
    assert [a.tier.lookup(k, ctx) for k in keys] == [RETRY, RETRY]
    assert h.lookup_all(a, ctx, keys) == [HIT, HIT]
    assert b.parent.calls[0][0] == "on_new_request"
    assert b.parent.errors == []
    h.finish(a, ctx)
    h.check()


# --- submit_store --------------------------------------------------------------------


@pytest.mark.parametrize("role", ["plain", "consumer"])
def test_submit_store_without_a_decoder_succeeds_at_once(
    h: Harness, a: Engine, b: Engine, role: str
) -> None:
    """No ``remote_decoder``: the blocks just stay in the CPU tier (PD semantics)."""
    params = None if role == "plain" else source("remote_kv_source", new_id("kv"), b)
    ctx, _ = h.open(a, params)
    keys = new_keys(2)
    a.put(keys)
    job = h.store(a, ctx, keys)
    a.parent.take(a.tier.get_finished_jobs())  # the very next call reports it
    assert a.parent.results[job].success is True
    h.check()


@pytest.mark.parametrize("kv_id", [None, ""])
def test_submit_store_for_a_decoder_without_id_fails(
    h: Harness, a: Engine, kv_id: str | None
) -> None:
    ctx, _ = h.open(a, {"remote_decoder": {} if kv_id is None else {"kv_request_id": kv_id}})
    keys = new_keys(2)
    a.put(keys)
    job = h.store(a, ctx, keys)
    a.parent.take(a.tier.get_finished_jobs())
    assert a.parent.results[job].success is False
    h.check()


def test_store_before_the_fetch_is_parked_then_served(h: Harness, a: Engine, b: Engine) -> None:
    """PD, the usual order: the prefiller stores and finishes, then the decoder fetches.

    The parked store creates no session (a stray top-level host/port is ignored);
    the decoder's fetch binds it; the store job is reported once, as a success.
    """
    kv_id = new_id("pd")
    keys = new_keys(4)
    src = b.put(keys)
    sessions_before = b.sessions()
    nowhere = free_port()
    pctx, policy = h.open(b, {**decoder(kv_id), "remote_host": HOST, "remote_port": nowhere})
    assert policy.policy is OffloadPolicy.REQUEST_LEVEL
    store_job = h.store(b, pctx, keys)
    for _ in range(20):
        h.step()
        time.sleep(0.001)
    assert store_job not in b.parent.results  # parked
    assert b.sessions() == sessions_before
    assert b.tier.node.peers.session(f"{HOST}:{nowhere}") is None
    h.finish(b, pctx)  # the prefill is done; the blocks wait for the decoder

    ctx, _ = h.open(a, source("remote_prefiller", kv_id, b))
    assert [a.tier.lookup(k, ctx) for k in keys] == [HIT] * 4
    dst = a.chunks(4)
    load_job = h.load(a, ctx, keys, dst)
    assert h.result(a, load_job).success is True
    assert h.result(b, store_job).success is True
    assert_bytes_moved(b, src, a, dst)
    h.finish(a, ctx)
    h.check()
    assert b.parent.reported[store_job] == 1


def test_fetch_before_the_store_waits_for_it(
    h: Harness, a: Engine, b: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PD, the other order: the decoder's fetch arrives first and binds the request.

    Meanwhile the load is in flight: ``has_pending_work()`` is true and
    ``drain_jobs()`` waits for it, but only up to its bound (a fake clock
    here, so the test does not wait 30 s). The store then completes the load.
    """
    kv_id = new_id("pd")
    keys = new_keys(3)
    src = b.put(keys)
    ctx, _ = h.open(a, source("remote_prefiller", kv_id, b))
    dst = a.chunks(3)
    load_job = h.load(a, ctx, keys, dst)
    h.steps_until(lambda: bool(b.events("FetchReceived", kv_id)), "b received the fetch")
    assert load_job not in a.parent.results
    assert a.tier.has_pending_work() is True
    assert a.tier.node.has_transfers_in_flight() is True

    clock = SimpleNamespace(now=0.0, sleeps=0)

    def monotonic() -> float:
        clock.now += 1.0
        return clock.now

    def sleep(_: float) -> None:
        clock.sleeps += 1

    with monkeypatch.context() as m:
        m.setattr(adapter, "time", SimpleNamespace(monotonic=monotonic, sleep=sleep))
        a.tier.drain_jobs()  # returns: bounded, though the load is still in flight
    assert clock.sleeps > 0
    assert load_job not in a.parent.results

    pctx, _ = h.open(b, decoder(kv_id))
    store_job = h.store(b, pctx, keys)
    assert h.result(a, load_job).success is True
    assert h.result(b, store_job).success is True
    assert_bytes_moved(b, src, a, dst)
    h.finish(b, pctx)
    h.finish(a, ctx)
    h.check()


def test_unbound_stores_are_reaped_and_reported_failed(h: Harness) -> None:
    """Stored blocks no fetch came for are released after ``unbound_store_timeout_s``."""
    producer = h.add(Engine("reaper", unbound_store_timeout_s=0.2))
    kv_id = new_id("pd")
    keys = new_keys(2)
    producer.put(keys)
    pctx, _ = h.open(producer, decoder(kv_id))
    first = h.store(producer, pctx, keys[:1])
    second = h.store(producer, pctx, keys[1:])
    assert h.result(producer, first).success is False
    assert h.result(producer, second).success is False
    h.finish(producer, pctx)
    h.retire(producer)
    h.check()


def test_a_fetch_for_a_reaped_request_fails_at_once(h: Harness, a: Engine) -> None:
    """vLLM 0.33: a fetch for a reaped id gets transfer_done(False) at once."""
    producer = h.add(Engine("reaper", unbound_store_timeout_s=0.2))
    kv_id = new_id("pd")
    keys = new_keys(2)
    producer.put(keys)
    pctx, _ = h.open(producer, decoder(kv_id))
    store_job = h.store(producer, pctx, keys)
    assert h.result(producer, store_job).success is False  # reaped
    ctx, _ = h.open(a, source("remote_prefiller", kv_id, producer))
    load_job = h.load(a, ctx, keys, a.chunks(2))
    try:
        assert h.result(a, load_job, timeout=3.0).success is False
    finally:
        h.finish(a, ctx)
        h.finish(producer, pctx)
        with contextlib.suppress(AssertionError):
            h.result(a, load_job, timeout=10.0)
    h.retire(producer)
    h.check()


# --- submit_load ---------------------------------------------------------------------


@pytest.mark.parametrize("role", ["no params", "producer only"])
def test_submit_load_without_a_source_fails(h: Harness, a: Engine, role: str) -> None:
    ctx, _ = h.open(a, None if role == "no params" else decoder(new_id("kv")))
    keys = new_keys(2)
    job = h.load(a, ctx, keys, a.chunks(2))
    assert h.result(a, job).success is False
    h.check()


def test_submit_load_of_no_keys_succeeds(h: Harness, a: Engine, b: Engine) -> None:
    kv_id = new_id("kv")
    ctx, _ = h.open(a, source("remote_kv_source", kv_id, b))
    job = h.load(a, ctx, [], [])
    assert h.result(a, job).success is True
    assert b.events("FetchReceived", kv_id) == []
    h.finish(a, ctx)
    h.check()


def test_allowed_peers_default_to_their_environment_variable(
    h: Harness, b: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``P2PACTOR_ALLOWED_PEERS`` is the default of ``allowed_peers``; the option overrides it."""
    monkeypatch.setenv("P2PACTOR_ALLOWED_PEERS", f"{b.peer_id},{HOST}:2")
    from_env = h.add(Engine("allowed-env"))
    assert from_env.tier.node.config.allowed_peers == frozenset({b.peer_id, f"{HOST}:2"})
    chosen = h.add(Engine("allowed-option", allowed_peers=[f"{HOST}:3"]))
    assert chosen.tier.node.config.allowed_peers == frozenset({f"{HOST}:3"})


def test_a_peer_outside_allowed_peers_is_no_source_and_never_dialed(
    h: Harness, a: Engine, b: Engine
) -> None:
    """``allowed_peers`` (ours, not vLLM's): a request naming another peer is served locally."""
    guarded = h.add(Engine("guarded", allowed_peers=f" {b.peer_id} , {HOST}:1"))
    assert guarded.tier.node.config.allowed_peers == frozenset({b.peer_id, f"{HOST}:1"})
    keys = new_keys(2)
    a.put(keys)
    b.put(keys)
    for role in ("remote_kv_source", "remote_prefiller"):
        ctx, _ = h.open(guarded, source(role, new_id("kv"), a))
        assert [guarded.tier.lookup(k, ctx) for k in keys] == [MISS, MISS]
        job = h.load(guarded, ctx, keys, guarded.chunks(2))
        assert h.result(guarded, job).success is False
        assert [guarded.tier.lookup(k, ctx) for k in keys] == [MISS, MISS]
        h.finish(guarded, ctx)
    for _ in range(10):
        h.step()
        time.sleep(0.001)
    assert a.tier.node.peers.session(guarded.peer_id) is None
    assert guarded.tier.node.peers.session(a.peer_id) is None
    assert a.peer_id not in {r.peer_id for r in guarded.tier.node.peers.closed_sessions()}
    assert a.parent.calls == []
    assert not guarded.memory.any()
    # The allowed peer is used as usual.
    ctx, _ = h.open(guarded, source("remote_kv_source", new_id("kv"), b))
    assert h.lookup_all(guarded, ctx, keys) == [HIT, HIT]
    h.finish(guarded, ctx)
    h.retire(guarded)
    h.check()


# --- transfer_time and transfer_bytes of the job results ------------------------------


def test_a_load_and_the_pin_it_fetched_report_their_time_and_bytes(
    h: Harness, a: Engine, b: Engine
) -> None:
    """vLLM's tier metrics read ``transfer_time`` (s) and ``transfer_bytes`` of every job.

    The load: its blocks times the block bytes, timed from ``submit_load`` to
    the result. ``b``'s pin of those blocks (a store job of ``b``'s, created
    through the lent parent): the same bytes, timed from the pin to its release
    once the fetch was served.
    """
    started = time.monotonic()
    keys = new_keys(3)
    src = b.put(keys)
    ctx, _ = h.open(a, source("remote_kv_source", new_id("kv"), b))
    assert h.lookup_all(a, ctx, keys) == [HIT] * 3
    (pin,) = b.parent.pins  # one lookup, one job pinning its hits
    dst = a.chunks(3)
    submitted = time.monotonic()
    load = h.load(a, ctx, keys, dst)
    assert_transfer(h.result(a, load), success=True, blocks=3, within=time.monotonic() - submitted)
    assert_bytes_moved(b, src, a, dst)
    assert_transfer(h.result(b, pin), success=True, blocks=3, within=time.monotonic() - started)
    h.finish(a, ctx)
    h.check()
    assert_forgotten(a, load)
    assert_forgotten(b, pin)


def test_a_failed_load_and_store_report_no_bytes(h: Harness, a: Engine, b: Engine) -> None:
    """A failed job reports ``transfer_bytes`` 0 and the seconds until it failed.

    vLLM reads neither field of a failed job (``TieringMetricsTracker`` counts
    the bytes of successful keys only, and a load of ours has none: it is all or
    nothing); 0 says that nothing it can use arrived. PD here: the prefiller
    finishes without one demanded block, so the load and the store both fail.
    A load that fails at once (no source) took no time.
    """
    kv_id = new_id("pd")
    keys = new_keys(2)
    b.put(keys[:1])
    pctx, _ = h.open(b, decoder(kv_id))
    stored = time.monotonic()
    store = h.store(b, pctx, keys[:1])
    ctx, _ = h.open(a, source("remote_prefiller", kv_id, b))
    submitted = time.monotonic()
    load = h.load(a, ctx, keys, a.chunks(2))
    h.steps_until(lambda: bool(b.events("FetchReceived", kv_id)), "b received the fetch")
    h.finish(b, pctx)  # keys[1] will never be stored
    assert_transfer(h.result(a, load), success=False, blocks=2, within=time.monotonic() - submitted)
    assert_transfer(h.result(b, store), success=False, blocks=1, within=time.monotonic() - stored)
    h.finish(a, ctx)
    nowhere, _ = h.open(a, None)
    at_once = h.load(a, nowhere, keys, a.chunks(2))
    result = h.result(a, at_once)
    assert (result.success, result.transfer_time, result.transfer_bytes) == (False, 0.0, 0)
    h.check()
    assert_forgotten(a, load, at_once)
    assert_forgotten(b, store)


def test_a_served_store_reports_its_time_and_bytes(
    h: Harness, a: Engine, b: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """PD: the prefiller's store, parked until the decoder's fetch, then served.

    Its time runs from ``submit_store`` to its release after the write (the
    wait for the fetch included); its bytes are all of its blocks. It logs no
    WARNING. A store with no decoder moves nothing (success, 0 bytes, 0 s), one
    for a decoder without an id fails the same way, both reported at once.
    """
    caplog.set_level(logging.WARNING, logger="p2pactor.vllm")
    kv_id = new_id("pd")
    keys = new_keys(4)
    src = b.put(keys)
    pctx, _ = h.open(b, decoder(kv_id))
    stored = time.monotonic()
    store = h.store(b, pctx, keys)
    h.finish(b, pctx)
    ctx, _ = h.open(a, source("remote_prefiller", kv_id, b))
    dst = a.chunks(4)
    submitted = time.monotonic()
    load = h.load(a, ctx, keys, dst)
    assert_transfer(h.result(a, load), success=True, blocks=4, within=time.monotonic() - submitted)
    assert_transfer(h.result(b, store), success=True, blocks=4, within=time.monotonic() - stored)
    assert_bytes_moved(b, src, a, dst)
    h.finish(a, ctx)
    for params, success in ((None, True), (decoder(None), False)):
        other, _ = h.open(b, params)
        job = h.store(b, other, keys)
        b.parent.take(b.tier.get_finished_jobs())  # the very next call reports it
        result = b.parent.results[job]
        assert (result.success, result.transfer_time, result.transfer_bytes) == (success, 0.0, 0)
    h.check()
    assert_forgotten(a, load)
    assert_forgotten(b, store)
    assert adapter_warnings(caplog) == []


def test_a_timed_out_store_logs_one_warning(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """A store no fetch came for: one WARNING, naming the job and its request.

    vLLM's tier logs "store job N timed out"; ours says which job of which
    request failed after how long, and what to check, once for the job, with
    the request's context fields. The result carries the wait and no bytes.
    """
    caplog.set_level(logging.WARNING, logger="p2pactor.vllm")
    producer = h.add(Engine("reaper", unbound_store_timeout_s=0.2))
    kv_id = new_id("pd")
    keys = new_keys(2)
    producer.put(keys)
    pctx, _ = h.open(producer, decoder(kv_id))
    stored = time.monotonic()
    job = h.store(producer, pctx, keys)
    result = h.result(producer, job)
    assert_transfer(result, success=False, blocks=2, within=time.monotonic() - stored)
    assert result.transfer_time > 0.19  # released by the reap, unbound_store_timeout later
    assert_forgotten(producer, job)
    h.finish(producer, pctx)
    h.retire(producer)
    h.check()
    (line,) = adapter_warnings(caplog)
    message = line.getMessage()
    assert f"store job {job} of {kv_id} failed" in message
    assert "within unbound_store_timeout (0.2 s)" in message
    assert (line.kv_request_id, line.node) == (kv_id, producer.peer_id)


def test_store_bookkeeping_is_bounded(
    h: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past its bound the tier forgets its oldest store job, not the job itself.

    (The bound is for releases that never come: a node that died.) The
    forgotten job is still reported, without transfer figures (None: unknown)
    and without its WARNING; the others keep theirs.
    """
    caplog.set_level(logging.WARNING, logger="p2pactor.vllm")
    monkeypatch.setattr(vllm_jobs, "_MAX_TRACKED_STORES", 2)
    producer = h.add(Engine("bounded", unbound_store_timeout_s=0.2))
    kv_id = new_id("pd")
    keys = new_keys(3)
    producer.put(keys)
    pctx, _ = h.open(producer, decoder(kv_id))
    jobs = [h.store(producer, pctx, [k]) for k in keys]
    assert len(producer.tier.jobs.stores) == 2
    results = [h.result(producer, job) for job in jobs]
    oldest = results[0]
    assert (oldest.success, oldest.transfer_time, oldest.transfer_bytes) == (False, None, None)
    for result in results[1:]:
        assert result.success is False
        assert result.transfer_bytes == 0
        assert result.transfer_time is not None
    assert producer.tier.jobs.stores == {}
    h.finish(producer, pctx)
    h.retire(producer)
    h.check()
    logged = sorted(int(line.getMessage().split()[2]) for line in adapter_warnings(caplog))
    assert logged == jobs[1:]


# --- on_request_finished -------------------------------------------------------------


def test_consumer_finish_closes_an_open_lookup_on_the_producer(
    h: Harness, a: Engine, b: Engine
) -> None:
    """The key is HIT_PENDING on ``b``: its lookup is open when ``a`` finishes.

    ``a`` sends the terminal empty fetch; ``b`` drops the lookup and finishes
    its synthetic request (at its next serve), long before the 5 s deadline.
    """
    keys = new_keys(2)
    b.parent.pending.update(keys)
    kv_id = new_id("kv")
    ctx, _ = h.open(a, source("remote_kv_source", kv_id, b))
    assert [a.tier.lookup(k, ctx) for k in keys] == [RETRY, RETRY]
    h.steps_until(
        lambda: any(m == "lookup" for m, _ in b.parent.calls),
        "b asked its parent about the pending keys",
    )
    assert [a.tier.lookup(k, ctx) for k in keys] == [RETRY, RETRY]
    assert len(b.parent.open) == 1
    h.finish(a, ctx)
    h.steps_until(lambda: not b.parent.open, "b finished its synthetic request")
    dropped = b.events("LookupDropped", kv_id)
    assert [e.reason for e in dropped] == ["the consumer finished the request (empty fetch)"]
    assert b.events("PendingExpired", kv_id) == []
    h.check()


def test_consumer_finish_releases_the_producers_pins(h: Harness, a: Engine, b: Engine) -> None:
    """Looked up and pinned, never fetched: finishing releases ``b``'s pins."""
    keys = new_keys(3)
    b.put(keys)
    ctx, _ = h.open(a, source("remote_kv_source", new_id("kv"), b))
    assert h.lookup_all(a, ctx, keys) == [HIT] * 3
    assert b.parent.pins  # held for a's fetch
    h.finish(a, ctx)
    h.steps_until(lambda: not b.parent.pins, "b's pins released")
    assert all(r.success is False for r in b.parent.results.values())
    h.check()


def test_a_failed_load_makes_lookups_miss_until_the_request_finishes(
    h: Harness, a: Engine, b: Engine
) -> None:
    """PD: the prefiller finishes without one demanded block, so the load fails.

    Until ``a`` finishes the request, its lookups answer MISS (prefill
    locally) instead of the PD HIT; afterwards the id is no longer failed.
    """
    kv_id = new_id("pd")
    keys = new_keys(2)
    b.put(keys[:1])
    pctx, _ = h.open(b, decoder(kv_id))
    store_job = h.store(b, pctx, keys[:1])
    ctx, _ = h.open(a, source("remote_prefiller", kv_id, b))
    load_job = h.load(a, ctx, keys, a.chunks(2))
    h.steps_until(lambda: bool(b.events("FetchReceived", kv_id)), "b received the fetch")
    h.finish(b, pctx)  # keys[1] will never be stored
    assert h.result(a, load_job).success is False
    assert h.result(b, store_job).success is False
    assert [a.tier.lookup(k, ctx) for k in [*keys, *new_keys(1)]] == [MISS] * 3
    other, _ = h.open(a, source("remote_prefiller", new_id("pd"), b))
    assert a.tier.lookup(keys[0], other) is HIT  # only the failed id misses
    h.finish(a, ctx)
    assert a.tier.lookup(keys[0], ctx) is HIT
    h.check()


def test_a_producer_that_goes_away_fails_the_inflight_load(h: Harness, a: Engine) -> None:
    """Upstream's dead-session reaping: the load fails, its id misses until finished."""
    prefiller = h.add(Engine("prefiller"))
    kv_id = new_id("pd")
    keys = new_keys(2)
    ctx, _ = h.open(a, source("remote_prefiller", kv_id, prefiller))
    load_job = h.load(a, ctx, keys, a.chunks(2))
    h.steps_until(
        lambda: bool(prefiller.events("FetchReceived", kv_id)), "the prefiller got the fetch"
    )
    h.retire(prefiller)  # its engine stops; nothing was ever stored
    assert h.result(a, load_job).success is False
    assert a.tier.lookup(keys[0], ctx) is MISS
    h.steps_until(lambda: prefiller.peer_id not in a.sessions(), "a's session with it closed")
    assert prefiller.peer_id in {r.peer_id for r in a.tier.node.peers.closed_sessions()}
    h.finish(a, ctx)
    assert a.tier.lookup(keys[0], ctx) is HIT
    h.check()


def test_on_request_finished_without_a_role_is_a_no_op(h: Harness, a: Engine) -> None:
    for params in (None, {}, decoder(None)):
        ctx, _ = h.open(a, params)
        h.finish(a, ctx)
    ctx = ReqContext(req_id=new_id("unseen"), kv_transfer_params=None)
    a.tier.on_request_finished(ctx)  # never announced by on_new_request
    h.check()
    assert a.parent.calls == []


# --- get_finished_jobs, has_pending_work, drain_jobs ---------------------------------


def test_idle_tiers_have_no_pending_work_and_drain_at_once(h: Harness, a: Engine) -> None:
    h.settle()
    a.tier.drain_jobs()
    assert a.tier.node.has_transfers_in_flight() is False
    h.steps_until(lambda: not a.tier.has_pending_work(), "a idle")
    h.check()


def test_an_idle_tier_has_no_pending_work_right_after_a_step(h: Harness, a: Engine) -> None:
    """vLLM asks ``has_pending_work()`` right after a step, before the next ``schedule()``.

    An idle engine stops stepping only if its tiers answer False then; a tier
    that answers True after each step of its own keeps it stepping forever.
    """
    h.settle()
    busy = 0
    for _ in range(20):
        h.step([a])
        busy += a.tier.has_pending_work()
        time.sleep(0.001)
    assert busy == 0, f"has_pending_work() right after {busy} of 20 idle steps"


def test_drain_jobs_waits_for_an_inflight_load(h: Harness, a: Engine, b: Engine) -> None:
    """``drain_jobs()`` (vLLM's reset_cache) returns only once the in-flight load is written.

    The load is a PD fetch that waits for the prefiller's store; the store comes
    from another thread (``b``'s engine) while ``a`` drains, and nobody steps.
    """
    kv_id = new_id("pd")
    keys = new_keys(3)
    src = b.put(keys)
    ctx, _ = h.open(a, source("remote_prefiller", kv_id, b))
    dst = a.chunks(3)
    load_job = h.load(a, ctx, keys, dst)
    h.steps_until(lambda: bool(b.events("FetchReceived", kv_id)), "b received the fetch")
    assert a.tier.node.has_transfers_in_flight() is True
    pctx, _ = h.open(b, decoder(kv_id))
    store = b.parent.new_job("store", keys, src, pctx)
    prefiller = threading.Timer(0.2, b.tier.submit_store, (store,))
    prefiller.start()
    try:
        a.tier.drain_jobs()
        assert not prefiller.is_alive()  # drain_jobs waited for the store, and the write
        assert a.tier.node.has_transfers_in_flight() is False
        assert_bytes_moved(b, src, a, dst)
    finally:
        prefiller.join()
    assert h.result(a, load_job).success is True
    assert h.result(b, store.job_id).success is True
    h.finish(b, pctx)
    h.finish(a, ctx)
    h.check()


def test_drain_jobs_waits_for_a_load_submitted_just_before(
    h: Harness, a: Engine, b: Engine
) -> None:
    """vLLM's submit_load registers the load at once, so a drain right after covers it.

    The node's thread is held busy (a callback that blocks it for up to 2 s,
    standing in for a burst of work) while ``a`` submits the load and drains.
    """
    keys = new_keys(4)
    src = b.put(keys)
    ctx, _ = h.open(a, source("remote_kv_source", new_id("kv"), b))
    assert h.lookup_all(a, ctx, keys) == [HIT] * 4
    h.steps_until(lambda: not a.tier.has_pending_work(), "a idle")
    time.sleep(0.05)
    drained = threading.Event()
    a.tier.node._wakeup.token.run_sync_soon(drained.wait, 2.0)  # the node thread is busy
    dst = a.chunks(4)
    job = h.load(a, ctx, keys, dst)
    try:
        a.tier.drain_jobs()
        assert_bytes_moved(b, src, a, dst)
    finally:
        drained.set()
        assert h.result(a, job).success is True
        h.finish(a, ctx)
    h.check()


# --- both ways at once -----------------------------------------------------------------


def test_two_tiers_load_and_store_both_ways(h: Harness, a: Engine, b: Engine) -> None:
    """Upstream's bidirectional managers, on real sockets and NIXL.

    Each tier is at once a symmetric consumer of the other, a PD producer for
    the other and a PD consumer of the other; every load and store succeeds,
    the bytes arrive, and every job is reported exactly once (``check``).
    """
    sym_a, sym_b = new_keys(4), new_keys(4)  # held by b / by a, looked up by the other
    miss_a, miss_b = new_keys(3), new_keys(3)  # held by nobody
    pd_a, pd_b = new_keys(3), new_keys(3)  # stored by a / by b for the other
    src_sym_b, src_sym_a = b.put(sym_a), a.put(sym_b)
    src_pd_a, src_pd_b = a.put(pd_a), b.put(pd_b)
    kv_pd_a, kv_pd_b = new_id("pd-a"), new_id("pd-b")

    prod_a, _ = h.open(a, decoder(kv_pd_a))
    prod_b, _ = h.open(b, decoder(kv_pd_b))
    stores = [(a, h.store(a, prod_a, pd_a)), (b, h.store(b, prod_b, pd_b))]

    cons_a, _ = h.open(a, source("remote_kv_source", new_id("sym-a"), b))
    cons_b, _ = h.open(b, source("remote_kv_source", new_id("sym-b"), a))
    answers: dict[str, list[LookupResult]] = {}

    def both_answered() -> bool:
        answers["a"] = [a.tier.lookup(k, cons_a) for k in [*sym_a, *miss_a]]
        answers["b"] = [b.tier.lookup(k, cons_b) for k in [*sym_b, *miss_b]]
        return all(RETRY not in v for v in answers.values())

    h.steps_until(both_answered, "both tiers' lookups answered")
    assert answers == {"a": [HIT] * 4 + [MISS] * 3, "b": [HIT] * 4 + [MISS] * 3}

    pdc_a, _ = h.open(a, source("remote_prefiller", kv_pd_b, b))
    pdc_b, _ = h.open(b, source("remote_prefiller", kv_pd_a, a))
    dst = {name: (e.chunks(4), e.chunks(3)) for name, e in (("a", a), ("b", b))}
    loads = [
        (a, h.load(a, cons_a, sym_a, dst["a"][0])),
        (b, h.load(b, cons_b, sym_b, dst["b"][0])),
        (a, h.load(a, pdc_a, pd_b, dst["a"][1])),
        (b, h.load(b, pdc_b, pd_a, dst["b"][1])),
    ]
    for engine, job in [*loads, *stores]:
        assert h.result(engine, job).success is True, (engine.name, job)
    assert_bytes_moved(b, src_sym_b, a, dst["a"][0])
    assert_bytes_moved(a, src_sym_a, b, dst["b"][0])
    assert_bytes_moved(b, src_pd_b, a, dst["a"][1])
    assert_bytes_moved(a, src_pd_a, b, dst["b"][1])
    h.check()


# --- construction and shutdown -------------------------------------------------------


def test_a_vllm_with_no_tier_poll_thread_is_refused_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM 0.32 and older serve tiers only at engine steps: an idle engine
    # would never answer its peers, so the tier refuses to start there.
    monkeypatch.setattr(vllm_api, "POLLS_TIERS", False)
    view = memoryview(torch.zeros(4, CHUNK_BYTES, dtype=torch.uint8).numpy())
    with pytest.raises(ValueError, match=r"needs vLLM 0\.33 or newer.*Upgrade vLLM") as err:
        P2PActorTierManager(offloading_spec(), view, host=HOST, port=free_port())
    assert "0.33.0" in str(err.value)  # the version it found


def test_this_vllm_polls_its_tiers() -> None:
    assert vllm_api.POLLS_TIERS is True
    assert P2PActorTierManager.tolerates_off_thread_polling is True


def test_backpressure_is_refused() -> None:
    view = memoryview(torch.zeros(4, CHUNK_BYTES, dtype=torch.uint8).numpy())
    with pytest.raises(ValueError, match="Backpressure is not supported"):
        P2PActorTierManager(
            offloading_spec(), view, host=HOST, port=free_port(), backpressure_detector=object()
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"no_such_option": 1},
        {"no_such_option": None},
        {"unbound_store_timeout_s": 0},
        {"unbound_store_timeout_s": None},
        {"unbound_store_timeout_s": -1.0},
        {"slow_step_ms": -1},
        {"slow_step_ms": "often"},
        {"slow_step_ms": True},
        {"pin_timeout_s": 0},
        {"pin_lease_cap_s": "long"},
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any]) -> None:
    view = memoryview(torch.zeros(4, CHUNK_BYTES, dtype=torch.uint8).numpy())
    threads = _node_threads()
    with pytest.raises(ValueError, match="p2pactor tier"):
        P2PActorTierManager(offloading_spec(), view, host=HOST, port=free_port(), **kwargs)
    assert _node_threads() == threads  # no node was started


def test_vllm_only_options_are_accepted(h: Harness, b: Engine) -> None:
    """``backends`` and ``num_threads`` (vLLM's tier's entry), and ``locality``."""
    engine = h.add(
        Engine("vllm-options", backends=["UCX"], num_threads=8, locality="remote", tier_type="p2p")
    )
    assert engine.tier.node.config.fingerprint != ""  # the stand-in spec is real enough
    assert engine.tier.node.config.fingerprint == b.tier.node.config.fingerprint
    h.retire(engine)
    h.check()


def test_the_slow_step_watch_is_an_option(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """``slow_step_ms`` sets the node's threshold over ``P2PACTOR_SLOW_STEP_MS``; 0 is off."""
    monkeypatch.setenv("P2PACTOR_SLOW_STEP_MS", "20")
    by_env = h.add(Engine("watch-env"))
    chosen = h.add(Engine("watch-chosen", slow_step_ms=5))
    off = h.add(Engine("watch-off", slow_step_ms=0))
    assert by_env.tier.node.config.slow_step_s == 0.02
    assert chosen.tier.node.config.slow_step_s == 0.005
    assert off.tier.node.config.slow_step_s is None
    assert chosen.tier.node.loop_watch.snapshot().slow_step_s == 0.005
    for engine in (by_env, chosen, off):
        h.retire(engine)
    h.check()


def test_the_pin_timers_are_options(h: Harness) -> None:
    """``pin_timeout_s`` and ``pin_lease_cap_s`` set the producer's pin timers."""
    engine = h.add(Engine("leases", pin_timeout_s=1.0, pin_lease_cap_s=5))
    timings = engine.tier.node.config.timings
    assert (timings.pin_timeout, timings.pin_lease_cap) == (1.0, 5)
    assert timings.load_timeout == 30.0  # the others keep vLLM's
    h.retire(engine)
    h.check()


def test_shutdown_closes_cleanly_and_frees_the_port(h: Harness, b: Engine) -> None:
    """Shut down holding a pin and an open lookup on ``b``.

    The node thread ends; ``b`` releases the pin and finishes the open
    synthetic request at its next serves (upstream's failed-serve contexts);
    the port can be bound again, by a tier that works. A second
    ``shutdown()`` does nothing.
    """
    before = _node_threads()
    leaving = h.add(Engine("leaving"))
    ours = _node_threads() - before
    assert len(ours) == 1
    keys, pending = new_keys(2), new_keys(1)
    b.put(keys)
    b.parent.pending.update(pending)
    ctx, _ = h.open(leaving, source("remote_kv_source", new_id("kv"), b))
    assert h.lookup_all(leaving, ctx, keys) == [HIT, HIT]
    assert b.parent.pins
    open_ctx, _ = h.open(leaving, source("remote_kv_source", new_id("kv"), b))
    assert leaving.tier.lookup(pending[0], open_ctx) is RETRY
    h.steps_until(lambda: bool(b.parent.open), "b's lookup for it is open")
    # The engine goes away mid-request (its requests never finish).
    for c in (ctx, open_ctx):
        del h.requests[leaving.name, c.req_id]
    h.engines.remove(leaving)
    leaving.tier.shutdown()
    assert not any(t.is_alive() for t in ours)
    leaving.tier.shutdown()  # again: harmless
    leaving.shut = True
    h.steps_until(lambda: not b.parent.pins and not b.parent.open, "b released the pins")
    h.steps_until(lambda: leaving.peer_id not in b.sessions(), "b's session with it closed")
    again = h.add(Engine("again", port=leaving.port))  # the port is free
    assert again.tier.node.node_id == leaving.peer_id
    # ... and the new tier at that address works.
    ctx, _ = h.open(again, source("remote_kv_source", new_id("kv"), b))
    assert h.lookup_all(again, ctx, keys) == [HIT, HIT]
    h.finish(again, ctx)
    h.retire(again)
    h.check()


# --- vLLM API variants ---------------------------------------------------------------


def test_lookup_results_map_both_ways() -> None:
    from vllm.v1.kv_offload.base import LookupResult as VllmLookupResult  # noqa: PLC0415

    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415

    for ours in LookupResult:
        theirs = vllm_api.TO_VLLM[ours]
        assert theirs is getattr(VllmLookupResult, ours.name)
        assert vllm_api.from_vllm(theirs) is ours


def test_job_chunk_ids_are_read_from_the_transfer_job() -> None:
    assert vllm_api.job_ids(SimpleNamespace(chunk_ids=np.array([3, 4]))) == [3, 4]


def test_ctrl_c_while_the_node_starts_stays_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting for the node's thread, Ctrl-C is not reported as a start that timed out."""
    node = NodeThread(NodeConfig(host="127.0.0.1"), memoryview(bytearray(64)), None)
    monkeypatch.setattr(node, "_thread", threading.Thread(target=lambda: None))

    def interrupted(timeout: float | None = None) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(node._started, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        node.start()
