"""p2pactor's tier inside vLLM 0.33's own offloading stack, engine to engine.

Every engine here is vLLM's ``TieringOffloadingManager`` as its
``get_manager()`` builds it, stepped in the call pattern of vLLM's
``OffloadingConnectorScheduler`` (``tests/vllm_stack.py``): vLLM decides what
to look up, promotes, pins, stores and cascades; its tier-poll thread serves
peers between steps. Real ZeroMQ and NIXL on 127.0.0.1. Each test checks the
outcome (every loaded byte against what the producer computed, vLLM's own
counters, our producers' events), and ends with every node settled: no job in
flight, no chunk pinned, every synthetic request closed, no contract
violation, no offload region left in /dev/shm.

``tests/test_vllm_tier.py`` checks the tier's contract call by call with a
parent of its own, where vLLM's stack cannot be made to answer HIT_PENDING or
RETRY at a chosen moment, nor to report a job twice; the flows are here.
"""

from __future__ import annotations

import hashlib
import itertools
import socket
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.manager", reason="vLLM 0.33 (tiered KV offloading) is not installed"
)

import numpy as np
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from p2pactor.programs.vllmstack import StackOptions, spec_of, tier_entry
from p2pactor.programs.vllmstack.engine import Phase, StackRequest
from tests.ports import free_port
from tests.vllm_stack import (
    CHUNK_BYTES,
    HOST,
    StackNode,
    node_threads,
    open_nodes,
    run_until,
    settle,
)

_keys = itertools.count()


def new_keys(n: int) -> list[bytes]:
    """``n`` OffloadKeys unique in this module (a block hash, then group 0)."""
    return [
        make_offload_key(hashlib.sha256(b"stack %d" % next(_keys)).digest(), 0) for _ in range(n)
    ]


def ask(node: StackNode, keys: list[bytes], params: dict[str, Any] | None) -> StackRequest:
    """A request for ``keys`` (and nothing more) on ``node``."""
    return node.engine.add(node.new_id(), keys, (), params)


def done(*reqs: StackRequest) -> Any:
    return lambda: all(r.phase is Phase.DONE for r in reqs)


def counter(node: StackNode, name: str) -> float:
    """A counter of vLLM's ``/metrics`` (``get_stats`` every step), summed over labels."""
    return sum(v for (n, _), v in node.engine.counters.items() if n == f"vllm:{name}")


def test_a_named_source_serves_the_hit_run_and_the_miss_is_computed_after_one_round() -> None:
    with open_nodes(("a", {}), ("b", {})) as (a, b):
        keys = new_keys(6)
        a.computed(keys[:4])
        assert a.holds(keys) == 4
        req = ask(b, keys, b.named(a, "named-1"))
        run_until([a, b], done(req), "b's request done")
        assert (req.loaded, req.promoted, req.wrong, req.aborted) == (4, 4, 0, False)
        # The two keys a never held were asked once, answered MISS, computed.
        assert len(a.producer_events("LookupReceived", "named-1")) == 1
        run_until([a, b], lambda: b.holds(keys) == 6, "b stored what it computed")
        # vLLM's own counters, and ours in its /metrics (get_stats), agree.
        assert counter(b, "kv_offload_tiering_read_bytes") == 4 * b.stack.memory.shape[1]
        # Ours reach vLLM's stats within 0.1 s: vLLM asks every step (here idle ones).
        ours = ("kv_offload_p2pactor_lookups", "kv_offload_p2pactor_blocks_received")

        def counted() -> bool:
            b.engine.step()
            return counter(b, ours[1]) > 0

        run_until([], counted, "our counters in vLLM's")
        assert (counter(b, ours[0]), counter(b, ours[1])) == (1, 4)
        settle([a, b])


def test_prefill_decode_a_store_parked_before_the_fetch_is_served() -> None:
    with open_nodes(("p", {}), ("d", {})) as (p, d):
        keys = new_keys(3)
        p.engine.compute(p.new_id(), keys, {"remote_decoder": {"kv_request_id": "pd-1"}})
        req = ask(d, keys, d.named(p, "pd-1", role="remote_prefiller"))
        run_until([p, d], done(req), "the decode request done")
        assert (req.loaded, req.promoted, req.wrong) == (3, 3, 0)
        assert p.producer_events("LookupReceived", "pd-1") == []  # no probing in PD
        settle([p, d])


def test_prefill_decode_a_fetch_before_the_store_waits_for_it() -> None:
    with open_nodes(("p", {}), ("d", {})) as (p, d):
        keys = new_keys(3)
        req = ask(d, keys, d.named(p, "pd-2", role="remote_prefiller"))
        run_until([p, d], lambda: p.producer_events("FetchReceived", "pd-2") != [], "the fetch")
        assert req.loaded == 0  # vLLM's promotion waits: the request's keys are HIT_PENDING
        p.engine.compute(p.new_id(), keys, {"remote_decoder": {"kv_request_id": "pd-2"}})
        run_until([p, d], done(req), "the decode request done")
        assert (req.loaded, req.promoted, req.wrong) == (3, 3, 0)
        settle([p, d])


def test_two_engines_load_from_each_other_at_once() -> None:
    with open_nodes(("a", {}), ("b", {})) as (a, b):
        mine, theirs = new_keys(4), new_keys(4)
        a.computed(mine)
        b.computed(theirs)
        from_a = ask(b, mine, b.named(a, "ab-1"))
        from_b = ask(a, theirs, a.named(b, "ab-2"))
        run_until([a, b], done(from_a, from_b), "both requests done")
        for req in (from_a, from_b):
            assert (req.loaded, req.promoted, req.wrong) == (4, 4, 0)
        settle([a, b])


def test_a_request_given_up_while_asking_releases_the_producers_pins() -> None:
    with open_nodes(("a", {}), ("b", {})) as (a, b):
        keys = new_keys(4)
        a.computed(keys)
        req = ask(b, keys, b.named(a, "gone-1"))
        b.engine.step()  # the lookup goes out
        # a's tier-poll thread answers it; b takes no step, so it fetches nothing.
        run_until([a], lambda: a.producer_events("LookupAnswered", "gone-1") != [], "answer")
        assert a.pinned() != []  # the answered HITs are pinned for b
        b.engine.abort(req)
        settle([a, b])
        assert a.producer_events("FetchReceived", "gone-1") == []
        assert a.holds(keys) == 4  # unpinned, and still a's


def test_a_named_source_that_is_gone_is_computed_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "1")
    with open_nodes(("a", {}), ("b", {})) as (a, b):
        keys = new_keys(3)
        a.computed(keys)
        a.shutdown()
        req = ask(b, keys, b.named(a, "dead-1"))
        run_until([b], done(req), "b's request done")
        assert (req.loaded, req.promoted, req.aborted) == (0, 0, False)
        run_until([b], lambda: b.holds(keys) == 3, "b stored what it computed")
        settle([b])


def test_a_peer_outside_allowed_peers_is_no_source() -> None:
    with open_nodes(("a", {}), ("b", {"allowed_peers": "127.0.0.1:1"})) as (a, b):
        keys = new_keys(2)
        a.computed(keys)
        req = ask(b, keys, b.named(a, "denied-1"))
        run_until([a, b], done(req), "b's request done")
        assert req.loaded == 0
        assert a.producer_events("LookupReceived", "denied-1") == []
        assert a.peer_id not in {s.peer_id for s in b.tier.node.peers.sessions()}
        settle([a, b])


def test_the_slow_step_watch_is_set_from_the_secondary_tiers_entry() -> None:
    """vLLM's ``SecondaryTierFactory`` hands the entry's ``slow_step_ms`` to the tier."""
    with open_nodes(("w", {"slow_step_ms": 7}), ("off", {"slow_step_ms": 0})) as (w, off):
        assert w.tier.node.config.slow_step_s == 0.007
        assert w.tier.node.loop_watch.snapshot().slow_step_s == 0.007
        assert off.tier.node.config.slow_step_s is None
        settle([w, off])


def test_a_request_naming_no_source_loads_from_the_peer_whose_summary_has_it() -> None:
    with (
        open_nodes(("d", {}), ("e", {})) as (d, e),
        open_nodes(("c", {"seed_peers": f"{d.peer_id},{e.peer_id}"})) as (c,),
    ):
        keys = new_keys(4)
        d.computed(keys)
        index = c.tier.node.directory.index
        run_until(
            [c, d, e], lambda: len(index.peer(d.peer_id).claims) >= 4, "d's summary reached c"
        )
        req = ask(c, keys, None)
        run_until([c, d, e], done(req), "c's request done")
        assert (req.loaded, req.promoted, req.wrong) == (4, 4, 0)
        kv_id = f"auto:{c.tier.node.node_id}:{req.req_id}"  # the id c's lookups carry
        assert len(d.producer_events("LookupReceived", kv_id)) == 1
        assert e.producer_events("LookupReceived", kv_id) == []
        settle([c, d, e])


@pytest.mark.parametrize("producer", ["stock", "ours"])
def test_a_mixed_pair_on_vllms_stack(producer: str) -> None:
    consumer = "ours" if producer == "stock" else "stock"
    with open_nodes(("p", {"kind": producer}), ("c", {"kind": consumer})) as (p, c):
        keys = new_keys(4)
        p.computed(keys)
        req = ask(c, keys, c.named(p, f"mixed-{producer}"))
        run_until([p, c], done(req), "the request done")
        assert (req.loaded, req.promoted, req.wrong) == (4, 4, 0)
        settle([p, c])


@pytest.mark.parametrize("kind", ["ours", "stock"])
def test_an_idle_engine_with_no_tier_poll_thread_serves_its_peers(kind: str) -> None:
    """VLLM's ``tier_poll_interval_s: 0``: the tier keeps its idle engine stepping to serve."""
    with open_nodes(("p", {"kind": kind, "tier_poll_interval_s": 0}), ("c", {})) as (p, c):
        assert p.stack.manager._tier_poll_thread is None  # vLLM started none
        keys = new_keys(4)
        p.computed(keys)
        assert p.engine.wants_step()  # idle, and still stepping, for its peers
        req = ask(c, keys, c.named(p, f"unpolled-{kind}"))
        run_until([p, c], done(req), "c's request done")
        assert (req.loaded, req.promoted, req.wrong) == (4, 4, 0)
        settle([p, c])


def refusal(kind: str, entry: dict[str, Any]) -> str:
    """VLLM's config path building tier ``kind`` from ``entry``: the message it refuses with."""
    spec = spec_of(StackOptions(tiers=[tier_entry(kind, HOST, free_port(), **entry)]))
    view = memoryview(np.zeros((4, CHUNK_BYTES), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"unbound_store_timeout_s|backpressure") as err:
        SecondaryTierFactory.create_secondary_tier(spec.secondary_tier_configs[0], view, spec)
    return str(err.value)


@pytest.mark.parametrize(
    ("entry", "by_the_tier"),
    [
        ({"backpressure": {"backpressure_cls": "EMABackpressureDetector"}}, True),
        ({"backpressure": {}}, False),  # vLLM's factory refuses it, before any tier
        ({"unbound_store_timeout_s": 0}, True),
        ({"unbound_store_timeout_s": -1.0}, True),
        ({"unbound_store_timeout_s": None}, True),
        ({"unbound_store_timeout_s": "soon"}, True),
    ],
)
def test_what_vllms_p2p_tier_refuses_ours_refuses_in_its_words_then_ours(
    entry: dict[str, Any], by_the_tier: bool
) -> None:
    threads = node_threads()
    stock, ours = refusal("stock", entry), refusal("ours", entry)
    assert ours.startswith(stock), (stock, ours)  # vLLM's exact words, read from its tier
    if by_the_tier:
        assert "p2pactor" not in stock
        assert "p2pactor" in ours[len(stock) :]  # then our advice
    assert node_threads() == threads  # no node was started


def test_shutdown_stops_the_node_thread_and_frees_the_port() -> None:
    before = node_threads()
    with open_nodes(("a", {})) as (a,):
        assert len(node_threads() - before) == 1
        port = a.port
    assert node_threads() - before == set()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # vLLM's manager.shutdown() closed our ROUTER


def test_a_request_whose_first_key_nobody_claims_prefills_in_the_same_step() -> None:
    with (
        open_nodes(("d", {})) as (d,),
        open_nodes(("c", {"seed_peers": d.peer_id})) as (c,),
    ):
        held = new_keys(2)
        d.computed(held)
        index = c.tier.node.directory.index
        run_until([c, d], lambda: len(index.peer(d.peer_id).claims) == 2, "d's summary reached c")
        req = ask(c, [*new_keys(2), *held], None)
        c.engine.step()
        assert req.decided == req.admitted  # decided in its first schedule: no wait
        assert (req.loaded, req.waited) == (0, 0)
        run_until([c, d], done(req), "c's request done")
        assert [e for e in c.tier.node.event_log.recent() if e.KIND == "Probed"] == []
        settle([c, d])


def test_what_vllms_lru_evicts_leaves_the_peers_claims() -> None:
    # d's CPU tier holds 16 chunks; vLLM evicts from it and tells no tier.
    with (
        open_nodes(("d", {"num_chunks": 16})) as (d,),
        open_nodes(("c", {"seed_peers": d.peer_id})) as (c,),
    ):
        index = c.tier.node.directory.index
        first, then = new_keys(12), new_keys(12)
        d.computed(first)
        run_until([c, d], lambda: len(index.peer(d.peer_id).claims) == 12, "d's summary reached c")
        d.computed(then)
        with d.stack.lock:
            evicted = [k for k in first if d.stack.primary.lookup(k, None).name == "MISS"]
        assert len(evicted) >= 8  # 24 chunks stored into 16

        from p2pactor.core.sources import fingerprint  # noqa: PLC0415 - one use

        def claimed_but_gone() -> list[bytes]:
            return [k for k in evicted if d.peer_id in index.claimed_by(fingerprint(k))]

        run_until([c, d], lambda: claimed_but_gone() == [], "the evicted keys left c's index")
        # And what d still holds is still claimed, up to its tier's size.
        with d.stack.lock:
            kept = [k for k in [*first, *then] if d.stack.primary.lookup(k, None).name == "HIT"]
        assert all(d.peer_id in index.claimed_by(fingerprint(k)) for k in kept)
        assert len(index.peer(d.peer_id).claims) <= 16
        settle([c, d])


def test_what_an_engine_writes_is_claimed_before_vllm_cascades_it() -> None:
    with (
        open_nodes(("d", {})) as (d,),
        open_nodes(("c", {"seed_peers": d.peer_id})) as (c,),
    ):
        index = c.tier.node.directory.index

        def summary_in() -> bool:
            position = index.position(d.peer_id)
            return position is not None and position[2]

        run_until([c, d], summary_in, "c has d's summary")
        keys = new_keys(4)
        req = ask(d, keys, None)  # nobody claims them: d computes them
        while req.phase is not Phase.DONE:  # ... and stores them in its CPU tier
            d.engine.step()
        # vLLM cascades the stores to its tiers at the end of d's next step; d
        # takes none, and c hears of them all the same.
        run_until([], lambda: len(index.peer(d.peer_id).claims) == 4, "c heard of d's keys")
        assert len(d.tier._watch) == 0  # followed to its last key
        settle([c, d])


class _MidScan:
    """Makes the peer's answers (and, naming nobody, the choice) land in a scan's middle.

    vLLM asks the tier key by key, promotes every HIT as soon as it hears it
    and scans on past a RETRY (``_maximal_prefix_lookup``). The producer
    cannot answer while its manager lock is held (its tier-poll thread serves
    lookups under it): entering takes it; at the first scan after ``armed``
    whose first key is asked and still unanswered, the lock is let go after
    that key's RETRY, and the scan goes on only once the answers (and the
    choice) are in.
    """

    def __init__(self, consumer: StackNode, producer: StackNode, kv_id: str, keys: list[bytes]):
        self.node = consumer.tier.node
        self.consumer = consumer
        self.producer = producer
        self.held = False
        self.kv_id = kv_id
        self.keys = keys
        self.armed = False
        self.hit = False
        self.undecided = False
        real = consumer.tier.lookup

        def lookup(key: Any, ctx: Any) -> Any:
            answer = real(key, ctx)
            if self.armed and not self.hit and bytes(key) == keys[0] and self._asked_unanswered():
                self.hit = True
                self.let_go()
                run_until([], self._answered, "the answers reached the consumer")
            return answer

        consumer.tier.lookup = lookup

    def __enter__(self) -> _MidScan:
        self.producer.stack.lock.acquire()
        self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        # Let go of the producer's lock however the test ended: vLLM's
        # shutdown() waits for it, and without it keeps the region in /dev/shm.
        self.let_go()
        del self.consumer.tier.lookup  # the tier's own again

    def let_go(self) -> None:
        if self.held:
            self.held = False
            self.producer.stack.lock.release()

    def _consumer(self) -> Any:
        decision = self.node.decision(self.kv_id)
        return self.node.known_consumer(self.producer.peer_id, self.kv_id), decision

    def _asked_unanswered(self) -> bool:
        actor, decision = self._consumer()
        if self.kv_id.startswith("auto:") and decision is None:
            self.undecided = True
            return True
        return (
            actor is not None
            and self.keys[0] in actor.state.probes
            and (actor.state.probes[self.keys[0]] is None)
        )

    def _answered(self) -> bool:
        actor, decision = self._consumer()
        if self.kv_id.startswith("auto:") and decision is None:
            return False
        return actor is not None and all(actor.state.probes.get(k) is True for k in self.keys)


def test_answers_landing_mid_scan_fetch_the_whole_run_in_one_round() -> None:
    with open_nodes(("a", {}), ("b", {})) as (a, b):
        keys = new_keys(4)
        a.computed(keys)
        with _MidScan(b, a, "mid-1", keys) as mid:
            req = ask(b, keys, b.named(a, "mid-1"))
            b.engine.step()  # the keys are asked at its end; a cannot answer yet
            run_until([], mid._asked_unanswered, "b's lookup sent")
            mid.armed = True
            run_until([b], lambda: mid.hit, "a scan with the answers out")  # a's lock is held
            run_until([a, b], done(req), "b's request done")
        assert mid.hit  # the answers did land mid-scan
        assert (req.loaded, req.promoted, req.wrong) == (4, 4, 0)
        # Had the scan heard its tail's HITs after its head's RETRY, vLLM would
        # have fetched the tail alone, and the head would have needed a round.
        assert len(a.producer_events("LookupReceived", "mid-1")) == 1
        assert len(b.producer_events("FetchSent", "mid-1")) == 1
        settle([a, b])


def test_a_choice_landing_mid_scan_fetches_the_whole_run_in_one_round() -> None:
    with (
        open_nodes(("d", {})) as (d,),
        open_nodes(("c", {"seed_peers": d.peer_id})) as (c,),
    ):
        index = c.tier.node.directory.index
        landed = 0
        for attempt in range(8):  # until the choice is out at a scan's start
            keys = new_keys(4)
            d.computed(keys)
            held = 4 * (attempt + 1)
            run_until([c, d], lambda: len(index.peer(d.peer_id).claims) >= held, "d's claims at c")  # noqa: B023
            req_id = c.new_id()
            kv_id = f"auto:{c.tier.node.node_id}:{req_id}"
            with _MidScan(c, d, kv_id, keys) as mid:
                req = c.engine.add(req_id, keys, (), None)
                c.engine.step()  # claimed: kept, handed to the node at the step's end
                mid.armed = True
                c.engine.step()  # the choice is being made (or made): the scan we want
                mid.let_go()  # if the choice beat the scan, it is tried again
                run_until([c, d], done(req), "c's request done")
            assert (req.loaded, req.promoted, req.wrong) == (4, 4, 0)
            assert len(d.producer_events("LookupReceived", kv_id)) == 1
            assert len(c.producer_events("FetchSent", kv_id)) == 1
            landed += mid.hit and mid.undecided
            if landed:
                break
        assert landed  # the choice did land mid-scan, at least once
        settle([c, d])
