"""p2pactor's figures in vLLM's own ``/metrics``: the tier's metric definitions and stats.

The definitions go through vLLM's own code, as its Prometheus frontend builds
them at start: ``TieringOffloadingSpec`` resolves our tier from a
``secondary_tiers`` entry naming this module, and ``OffloadPromMetrics`` turns
the definitions into Prometheus metrics (here in a registry of the test's own)
and observes the payloads ``get_stats`` returns, as the frontend does with
every scheduler step's stats. The figures come from a real pair of tiers
(``tests/test_vllm_tier.py``'s ``Engine`` and ``Harness``: real ZeroMQ and real
NIXL on 127.0.0.1), driven step by step like vLLM's scheduler drives them; the
tests read back what Prometheus holds and compare it with what happened:
lookups, keys by answer, blocks and bytes each way, failed transfers, sessions
and pins.

The node's thread publishes its figures for ``get_stats`` (every 0.1 s, when
they changed), so no test reads Prometheus after a fixed pause: each steps
the engines until every node is at rest and Prometheus shows exactly what the
node counted (:meth:`Scheduler.rest`), read on the node's own thread.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from tests.test_vllm_tier import (
    CHUNK_BYTES,
    HIT,
    MISS,
    TIMEOUT,
    Engine,
    Harness,
    assert_bytes_moved,
    decoder,
    new_id,
    new_keys,
    source,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2pactor.adapters._vllm_thread import METRICS, SERIES
from p2pactor.adapters.vllm import P2PActorTierManager

P = "vllm:kv_offload_p2pactor_"
# The engine's kv_connector_extra_config, as docs/vllm.md has it.
EXTRA_CONFIG: dict[str, Any] = {
    "spec_name": "TieringOffloadingSpec",
    "cpu_bytes_to_use": 1 << 20,
    "secondary_tiers": [
        {"type": "P2PActorTierManager", "module_path": "p2pactor.adapters.vllm", "port": 5710}
    ],
}
COUNTERS = {
    "lookups": (),
    "lookup_keys": ("outcome",),
    "served_lookups": (),
    "served_lookup_keys": ("outcome",),
    "blocks_received": (),
    "received_bytes": (),
    "blocks_written": (),
    "written_bytes": (),
    "transfers_failed": (),
    "quota_refusals": (),
    "handshakes": ("outcome",),
}
GAUGES = {"sessions": (), "peers": (), "actors": (), "pinned_blocks": ()}
HOLD_S = 10.0  # how long a test holds a node's thread at most
ENGINE_LABELS = {"model_name": "p2pactor/tiny-test-model", "engine": "0"}


def prometheus_frontend() -> tuple[CollectorRegistry, Any]:
    """vLLM's Prometheus metrics of the offloading connector, in a registry of their own."""
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=EXTRA_CONFIG)
    )
    prom = OffloadingConnector.build_prom_metrics(
        config, types, list(ENGINE_LABELS), {0: list(ENGINE_LABELS.values())}
    )
    return registry, prom


class Frontend:
    """vLLM's Prometheus frontend for one engine, fed by that engine's tier.

    Built as vLLM's stat logger builds it (``OffloadingConnector.build_prom_metrics``
    from the engine's extra config, vLLM's label names), over a registry of its
    own (vLLM's is process-wide). Each payload crosses vLLM's engine-to-frontend
    wire first: ``SchedulerStats`` in ``EngineCoreOutputs``, msgpack both ways.
    """

    def __init__(self, engine: Engine) -> None:
        self.tier = engine.tier
        self.registry, self.prom = prometheus_frontend()
        self.payloads: list[OffloadingConnectorStats] = []
        self._encode = MsgpackEncoder().encode
        self._decode = MsgpackDecoder(EngineCoreOutputs).decode

    def step(self) -> None:
        """One scheduler step's ``get_stats``, observed as vLLM's frontend does."""
        stats = self.tier.get_stats()
        if stats is not None:
            self.payloads.append(stats)
            outputs = EngineCoreOutputs(
                scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict())
            )
            received = self._decode(self._encode(outputs)).scheduler_stats
            self.prom.observe(received.kv_connector_stats, engine_idx=0)

    def value(self, metric: str, outcome: str | None = None) -> float:
        """A p2pactor series as Prometheus holds it (counters as their ``_total``)."""
        labels = dict(ENGINE_LABELS) if outcome is None else {**ENGINE_LABELS, "outcome": outcome}
        name = P + metric + ("_total" if metric in COUNTERS else "")
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    def unshown(self, totals: dict[str, float]) -> dict[str, tuple[float, float]]:
        """The node's ``totals`` Prometheus does not hold as counted: {figure: (held, counted)}."""
        out = {}
        for figure, counted in totals.items():
            series = SERIES[figure]
            labelnames = METRICS[series.metric.removeprefix(P)][2]
            labels = {**ENGINE_LABELS, **dict(zip(labelnames, series.labels, strict=True))}
            name = series.metric + ("" if series.gauge else "_total")
            held = self.registry.get_sample_value(name, labels) or 0.0
            if held != counted:
                out[figure] = (held, counted)
        return out

    def figures(self) -> dict[str, float]:
        """Every series this test asserts on, by ``metric`` or ``metric:outcome``."""
        out = {}
        for metric in (*COUNTERS, *GAUGES):
            outcomes = {"lookup_keys": ("hit", "miss", "timeout"), "handshakes": ("ok", "failed")}
            outcomes["served_lookup_keys"] = ("hit", "miss", "refused")
            for outcome in outcomes.get(metric, (None,)):
                key = metric if outcome is None else f"{metric}:{outcome}"
                out[key] = self.value(metric, outcome)
        return out


class Scheduler:
    """The harness's steps, with each engine's ``get_stats`` after every step."""

    def __init__(self, h: Harness, frontends: dict[str, Frontend]) -> None:
        self.h = h
        self.frontends = frontends

    def __getitem__(self, engine: Engine) -> Frontend:
        return self.frontends[engine.name]

    def step(self) -> None:
        self.h.step()
        for frontend in self.frontends.values():
            frontend.step()

    def until(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {TIMEOUT:g} s: {what}")
            self.step()
            time.sleep(0.002)

    def at_rest(self) -> dict[str, Any]:
        """Why the engines are not at rest yet, by engine (empty once they are).

        At rest: no tier has pending work, no node holds an actor or a pin,
        and Prometheus holds every figure exactly as the node counted it
        (read on the node's own thread, where it counts).
        """
        out: dict[str, Any] = {}
        for name, frontend in self.frontends.items():
            engine = next(e for e in self.h.engines if e.name == name)
            totals = node_totals(engine)
            busy = {k: totals[k] for k in ("actors", "pins_outstanding") if totals[k]}
            if engine.tier.has_pending_work():
                busy["pending work"] = True
            unshown = frontend.unshown(totals)
            if busy or unshown:
                out[name] = {**busy, "not in Prometheus (held, counted)": unshown}
        return out

    def rest(self) -> None:
        """Step until :meth:`at_rest` holds (every figure then is final)."""
        deadline = time.monotonic() + TIMEOUT
        while why := self.at_rest():
            if time.monotonic() > deadline:
                raise AssertionError(f"not at rest within {TIMEOUT:g} s: {why}")
            self.step()
            time.sleep(0.002)

    def settle(self) -> None:
        """Finish open requests, wait until the tiers are idle, then until at rest."""
        self.h.check()
        self.rest()


def node_totals(engine: Engine) -> dict[str, float]:
    """The figures the tier reports, as the node counts them now (read on its own thread)."""
    runner = engine.tier._runner
    surface = runner.surface
    assert runner._token is not None
    assert surface is not None

    def read() -> dict[str, float]:
        return {k: v for k, v in surface.metrics.totals().items() if k in SERIES}

    return trio.from_thread.run_sync(read, trio_token=runner._token)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Engine, Engine]]:
    a = Engine("a")
    try:
        b = Engine("b")
    except BaseException:
        a.shutdown()
        raise
    yield a, b
    b.shutdown()
    a.shutdown()


@pytest.fixture(scope="module")
def frontends(pair: tuple[Engine, Engine]) -> dict[str, Frontend]:
    """One frontend per engine for the module, as long-lived as the engine (vLLM's is)."""
    return {e.name: Frontend(e) for e in pair}


@pytest.fixture
def s(pair: tuple[Engine, Engine], frontends: dict[str, Frontend]) -> Iterator[Scheduler]:
    harness = Harness(*pair)
    yield Scheduler(harness, frontends)
    harness.settle(timeout=10)


def changes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


# --- definitions ----------------------------------------------------------------


def test_vllm_builds_the_tiers_metrics_from_its_secondary_tiers_entry() -> None:
    """vLLM's spec finds our definitions by the tier entry; its frontend registers them."""
    spec_cls = OffloadingSpecFactory.get_spec_cls(EXTRA_CONFIG)
    definitions = spec_cls.build_metric_definitions(EXTRA_CONFIG)
    ours = {name: d for name, d in definitions.items() if name.startswith(P)}
    assert ours == P2PActorTierManager.build_metric_definitions({})
    assert set(ours) == {P + m for m in (*COUNTERS, *GAUGES)}
    for metric, labels in COUNTERS.items():
        assert type(ours[P + metric]) is OffloadingCounterMetadata
        assert ours[P + metric].labelnames == labels
    for metric, labels in GAUGES.items():
        assert type(ours[P + metric]) is OffloadingGaugeMetadata
        assert ours[P + metric].labelnames == labels
    assert all(d.documentation for d in ours.values())

    registry, _ = prometheus_frontend()
    families = {
        f.name: f.type
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name.startswith(P)
    }
    assert families == {
        **{P + m: "counter" for m in COUNTERS},
        **{P + m: "gauge" for m in GAUGES},
    }


# --- figures --------------------------------------------------------------------


def test_a_lookup_and_its_load_reach_vllms_metrics_on_both_engines(
    s: Scheduler, pair: tuple[Engine, Engine]
) -> None:
    """``a`` looks 5 keys up on ``b`` (3 stored) and loads the 3 hits.

    Prometheus then holds, for ``a``: one lookup, 3 keys hit and 2 missed, 3
    blocks and their bytes received; for ``b``: one lookup served with the same
    answers, 3 blocks and bytes written, its 3 blocks pinned until the fetch
    (the gauge shows 3, then 0); a session and a ready peer on each side.
    """
    a, b = pair
    s.rest()
    a0, b0 = s[a].figures(), s[b].figures()
    keys = new_keys(5)
    src = b.put(keys[:3])
    ctx, _ = s.h.open(a, source("remote_kv_source", new_id("kv"), b))
    assert s.h.lookup_all(a, ctx, keys) == [HIT, HIT, HIT, MISS, MISS]
    s.until(lambda: s[b].value("pinned_blocks") == 3, "b's gauge shows the 3 pinned blocks")
    dst = a.chunks(3)
    job = s.h.load(a, ctx, keys[:3], dst)
    s.until(lambda: job in a.parent.results, "the load reported")
    assert a.parent.results[job].success is True
    assert_bytes_moved(b, src, a, dst)
    s.settle()

    assert changes(a0, s[a].figures()) == {
        "lookups": 1,
        "lookup_keys:hit": 3,
        "lookup_keys:miss": 2,
        "blocks_received": 3,
        "received_bytes": 3 * CHUNK_BYTES,
    } | _first_session(a0)
    assert changes(b0, s[b].figures()) == {
        "served_lookups": 1,
        "served_lookup_keys:hit": 3,
        "served_lookup_keys:miss": 2,
        "blocks_written": 3,
        "written_bytes": 3 * CHUNK_BYTES,
    } | _first_session(b0)
    for frontend in (s[a], s[b]):
        assert frontend.value("sessions") == 1
        assert frontend.value("peers") == 1
        assert frontend.value("pinned_blocks") == 0
        assert frontend.value("actors") == 0
        assert frontend.value("transfers_failed") == 0


def _first_session(before: dict[str, float]) -> dict[str, float]:
    """What the first test to run adds: the pair's one handshake and its gauges."""
    if before["handshakes:ok"]:
        return {}
    return {"handshakes:ok": 1, "sessions": 1, "peers": 1}


def test_get_stats_reports_increases_and_nothing_when_nothing_happened(
    s: Scheduler, pair: tuple[Engine, Engine]
) -> None:
    """Each payload carries what changed since the previous call, as vLLM's tiers do.

    Counters are increases (vLLM's frontend adds each payload to the Prometheus
    counter), so one round's payloads add up to that round alone, and an idle
    tier returns None. The round's payloads also go through vLLM's own
    ``aggregate`` (how the tiering manager and the scheduler merge stats) and
    ``reduce`` (its log line).
    """
    a, b = pair
    s.rest()
    assert [a.tier.get_stats() for _ in range(3)] == [None] * 3  # settled: nothing new
    before = s[a].figures()
    s[a].payloads.clear()
    keys = new_keys(3)
    b.put(keys[:2])
    ctx, _ = s.h.open(a, source("remote_kv_source", new_id("kv"), b))
    assert s.h.lookup_all(a, ctx, keys) == [HIT, HIT, MISS]
    s.settle()

    counted: Tally[tuple[str, tuple[str, ...]]] = Tally()
    gauges: dict[str, float] = {}
    for payload in s[a].payloads:
        types, values = payload.metric_sections()
        for metric, series in values.items():
            for labels, value in series.items():
                if types[metric] == "counter":
                    assert value > 0
                    counted[metric.removeprefix(P), labels] += value
                else:
                    gauges[metric.removeprefix(P)] = value
    expected = {("lookups", ()): 1, ("lookup_keys", ("hit",)): 2, ("lookup_keys", ("miss",)): 1}
    if _first_session(before):
        expected["handshakes", ("ok",)] = 1
    assert counted == expected
    assert changes(before, s[a].figures()) == {
        "lookups": 1,
        "lookup_keys:hit": 2,
        "lookup_keys:miss": 1,
    } | _first_session(before)
    assert gauges["sessions"] == 1

    merged = OffloadingConnectorStats()
    for payload in s[a].payloads:
        merged.aggregate(payload)
    reduced = merged.reduce()
    assert reduced[P + "lookups"] == 1
    assert reduced[f"{P}lookup_keys:('hit',)"] == 2
    assert reduced[f"{P}lookup_keys:('miss',)"] == 1
    assert reduced[P + "pinned_blocks"] == 0


def test_a_failed_load_is_counted(s: Scheduler, pair: tuple[Engine, Engine]) -> None:
    """PD: the prefiller finishes without one demanded block; ``a``'s load fails."""
    a, b = pair
    s.rest()
    a0, b0 = s[a].figures(), s[b].figures()
    kv_id = new_id("pd")
    keys = new_keys(2)
    b.put(keys[:1])
    pctx, _ = s.h.open(b, decoder(kv_id))
    s.h.store(b, pctx, keys[:1])
    ctx, _ = s.h.open(a, source("remote_prefiller", kv_id, b))
    job = s.h.load(a, ctx, keys, a.chunks(2))
    s.until(lambda: bool(b.events("FetchReceived", kv_id)), "b received the fetch")
    s.h.finish(b, pctx)  # keys[1] will never be stored
    s.until(lambda: job in a.parent.results, "the load reported")
    assert a.parent.results[job].success is False
    s.settle()
    assert changes(a0, s[a].figures()) == {"transfers_failed": 1} | _first_session(a0)
    # b wrote the block it had before it gave up on the other: written, not received.
    assert changes(b0, s[b].figures()) == {
        "blocks_written": 1,
        "written_bytes": CHUNK_BYTES,
    } | _first_session(b0)


# --- the engine's thread --------------------------------------------------------


def test_get_stats_never_waits_for_the_node_thread(
    pair: tuple[Engine, Engine], frontends: dict[str, Frontend]
) -> None:
    """get_stats answers while the node's thread is held: it reads what that thread published.

    The node's thread runs a step that the test holds until get_stats has
    returned (``HOLD_S`` at most). A get_stats that waited for the node's
    thread would return only once the hold gave up, and the hold records
    whether the test released it.
    """
    a, _ = pair
    runner = a.tier._runner
    assert runner._token is not None
    held, release, ended = threading.Event(), threading.Event(), threading.Event()
    released: list[bool] = []

    def hold() -> None:  # on the node's thread: nothing else runs there meanwhile
        held.set()
        released.append(release.wait(HOLD_S))
        ended.set()

    runner._token.run_sync_soon(hold)
    assert held.wait(TIMEOUT), "the node's thread never ran the hold"
    frontends[a.name].step()  # vLLM's get_stats, observed as its frontend does
    release.set()
    assert ended.wait(TIMEOUT)
    assert released == [True], "get_stats returned only once the node's thread was free"


def node_tasks(engine: Engine) -> list[str]:
    """The names of the tasks running on the node's thread (read there)."""
    runner = engine.tier._runner
    assert runner._token is not None

    def names() -> list[str]:
        out: list[str] = []
        todo = [trio.lowlevel.current_root_task()]
        while todo:
            task = todo.pop()
            out.append(task.name)
            todo += [t for n in task.child_nurseries for t in n.child_tasks]
        return out

    return trio.from_thread.run_sync(names, trio_token=runner._token)


def publishing(engine: Engine) -> bool:
    """Whether the node's thread still runs the task that publishes its figures."""
    return any(name.endswith("._publish_totals") for name in node_tasks(engine))


def test_a_failing_totals_stops_the_figures_not_the_tier(
    s: Scheduler, pair: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the node's metrics ends the tier's reports; lookups still work.

    The publishing task is seen to end after the bug; from then on nothing can
    publish, so the last ``get_stats`` is None however long one waited.
    """
    _, b = pair
    s.rest()
    hit_the_bug = threading.Event()

    def broken() -> dict[str, float]:
        hit_the_bug.set()
        raise RuntimeError("metrics bug")

    extra = s.h.add(Engine("broken"))
    try:
        # What it published before the bug.
        s.h.steps_until(lambda: extra.tier.get_stats() is not None, "extra's first figures")
        assert publishing(extra)
        monkeypatch.setattr(extra.tier._runner.surface.metrics, "totals", broken)
        s.h.steps_until(lambda: not publishing(extra), "the publishing task ended")
        assert hit_the_bug.is_set()
        extra.tier.get_stats()  # at most one more snapshot was published before the patch
        keys = new_keys(2)
        b.put(keys[:1])
        ctx, _ = s.h.open(extra, source("remote_kv_source", new_id("kv"), b))
        assert s.h.lookup_all(extra, ctx, keys) == [HIT, MISS]
        assert extra.tier.get_stats() is None
        s.h.retire(extra)
    finally:
        extra.shutdown()
