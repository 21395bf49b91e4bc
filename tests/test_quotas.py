"""Per-peer quotas: the core's refusals, the ledger's counts, nodes under a greedy peer.

* **Core**: every refusal path of :func:`step_producer` fed an
  :class:`~p2pactor.core.inputs.OverQuota` verdict or a parent answer with
  refused hits: what is sent, pinned, released and recorded (the harness checks
  after every step that replaying the log gives the live state).
* **Ledger**: :class:`~p2pactor.runtime.quotas.QuotaLedger` counts, verdicts, pins,
  isolation between peers, the rate-limited log.
* **Nodes** on the in-memory transports: a scripted peer goes over each quota;
  its counts return to zero after normal completion, after refusals and after
  its session dies; every pin is released; another peer is never affected;
  replay equals live.
* **Real transports**: a victim node on ZeroMQ + NIXL, a hostile raw peer in
  its own process (``tests/flood_peer.py``) flooding lookups, and an
  honest p2pactor node whose fetches still verify byte for byte.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import trio

from p2pactor.adapters.nixl import import_nixl, open_nixl_transport
from p2pactor.adapters.zmq import open_zmq_transport
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.events import Quota
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerInput, ProducerPhase, ProducerState
from p2pactor.errors import ConfigError, DataPlaneError
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.node import Node, open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.runtime.quotas import DEFAULT_QUOTAS, PeerQuotas, PeerUsage, QuotaLedger
from p2pactor.runtime.samples import block_bytes as real_block
from p2pactor.runtime.samples import preload_keys
from p2pactor.surface.replay import Replayer
from tests.cluster import block_bytes, open_cluster
from tests.harness import KV, PEER, ProducerHarness, key
from tests.test_session import node_and_peer

HIT, MISS = inp.LookupResult.HIT, inp.LookupResult.MISS


def verdict(
    message: wire.Lookup | wire.Fetch, quota: Quota = Quota.OPEN_LOOKUPS, admit: int = 0
) -> inp.OverQuota:
    return inp.OverQuota(message=message, quota=quota, reason="test says so", admit=admit)


def lookup_msg(*keys: bytes, round_seq: int = 0, kv: str = KV) -> wire.Lookup:
    return wire.Lookup(kv_request_id=kv, keys=keys, round_seq=round_seq)


def fetch_msg(keys: Sequence[bytes], round_seq: int = 0, kv: str = KV) -> wire.Fetch:
    return wire.Fetch(
        kv_request_id=kv,
        keys=tuple(keys),
        block_indexes=tuple(range(len(keys))),
        round_seq=round_seq,
    )


def stocked(*stored: int) -> ProducerHarness:
    h = ProducerHarness()
    h.cache.stored = {key(i): 10 + i for i in stored}
    return h


# --- the core: each refusal path --------------------------------------------------------


class TestCoreRefusals:
    def test_a_refused_lookup_is_answered_all_miss_at_once_and_pins_nothing(self) -> None:
        h = stocked(1, 2)
        h.feed(verdict(lookup_msg(key(1), key(2), key(1))))
        assert h.kinds() == ["LookupRefused", "Closed"]
        (refused,) = h.events_of(ev.LookupRefused)
        assert isinstance(refused, ev.LookupRefused)
        assert refused.quota is Quota.OPEN_LOOKUPS
        assert refused.reason == "test says so"
        (resp,) = h.sent
        # Every key a refusal, not a MISS (stock peers hear only the MISS).
        assert resp == wire.LookupResp(
            kv_request_id=KV,
            keys=(key(1), key(2), key(1)),
            hits=(False,) * 3,
            round_seq=0,
            refused=(True,) * 3,
        )
        assert h.cache.calls == []  # the parent was never asked
        assert h.cache.pins == {}
        assert h.state.phase is ProducerPhase.CLOSED
        assert h.retired

    def test_a_fetch_after_a_refused_lookup_in_a_live_request_fails_fast(self) -> None:
        h = stocked(1, 2)
        h.lookup(key(1), round_seq=0)  # round 0 pins key 1: the request stays open
        h.feed(verdict(lookup_msg(key(2), round_seq=1)))
        assert h.state.phase is ProducerPhase.OPEN
        assert h.state.looked_up_through == 1
        h.fetch([key(2)], [1], round_seq=1)  # never pinned: fails now, no parking
        done = h.sent_of(wire.TransferDone)
        assert [(m.round_seq, m.success) for m in done] == [(1, False)]  # type: ignore[attr-defined]
        assert h.state.phase is ProducerPhase.OPEN  # round 0's pin is still held
        h.fetch([], [], round_seq=2)
        assert h.pinned_jobs() == set()
        assert h.state.phase is ProducerPhase.CLOSED

    def test_protocol_rules_come_before_quotas(self) -> None:
        h = stocked(1)
        h.lookup(key(1), round_seq=0)
        h.fetch([key(1)], [0], round_seq=0)
        h.feed(verdict(lookup_msg(key(1), round_seq=0)))  # stale round: a violation
        assert h.kinds()[-1] == "Rejected"
        assert not h.events_of(ev.LookupRefused)
        assert h.disconnects

    def test_a_lookup_over_the_keys_quota_looks_up_only_its_first_keys(self) -> None:
        h = stocked(1, 2, 3)
        msg = lookup_msg(key(1), key(2), key(1), key(3), key(4))
        h.feed(verdict(msg, Quota.KEYS_PER_LOOKUP, admit=2))
        (limited,) = h.events_of(ev.LookupLimited)
        assert isinstance(limited, ev.LookupLimited)
        assert limited.admitted == 2
        assert [c for c in h.cache.calls if c[0] == "lookup"] == [
            ("lookup", key(1)),
            ("lookup", key(2)),
        ]
        assert list(h.cache.pins.values()) == [(key(1), key(2))]
        (resp,) = h.sent_of(wire.LookupResp)
        assert isinstance(resp, wire.LookupResp)
        # every key answered, in wire order: the admitted prefix as found, the
        # rest MISS although key 3 is stored, and so is key 1 past the prefix
        # (the keys past the quota are never looked at one by one)
        assert resp.keys == msg.keys
        assert resp.hits == (True, True, False, False, False)
        # The keys not looked up are refusals, not MISSes of what it lacks.
        assert resp.refused == (False, False, True, True, True)
        h.fetch([key(1), key(2)], [0, 1])
        h.complete_all()
        assert h.sent_of(wire.TransferDone)[-1].success  # type: ignore[attr-defined]
        assert h.pinned_jobs() == set()

    def test_a_keys_verdict_that_admits_every_key_is_a_plain_lookup(self) -> None:
        h = stocked(1)
        h.feed(verdict(lookup_msg(key(1)), Quota.KEYS_PER_LOOKUP, admit=5))
        assert "LookupReceived" in h.kinds()
        assert not h.events_of(ev.LookupLimited)

    def test_hits_over_the_pin_budget_answer_miss_and_are_not_pinned(self) -> None:
        h = ProducerHarness(auto_serve=False)
        h.cache.stored = {key(i): i for i in range(4)}
        h.lookup(key(0), key(1), key(2), key(3))
        (request,) = h.parent_queue
        h.parent_queue.clear()
        assert isinstance(request, fx_lookup_type())
        answer = serve_with_budget(h, request, budget=2)
        h.feed(answer)
        (refused,) = h.events_of(ev.KeysRefused)
        assert isinstance(refused, ev.KeysRefused)
        assert refused.keys == (key(2), key(3))
        assert refused.quota is Quota.PINNED_BLOCKS
        assert refused.reason == "over budget"
        (resp,) = h.sent_of(wire.LookupResp)
        assert resp.hits == (True, True, False, False)  # type: ignore[attr-defined]
        # The MISSes are refusals: the producer holds those keys.
        assert resp.refused == (False, False, True, True)  # type: ignore[attr-defined]
        assert list(h.cache.pins.values()) == [(key(0), key(1))]

    def test_pending_keys_resolving_later_count_against_the_pin_budget(self) -> None:
        h = ProducerHarness(auto_serve=False)
        h.cache.stored = {key(0): 0}
        h.cache.pending = {key(1), key(2)}
        h.lookup(key(0), key(1), key(2))
        h.feed(serve_with_budget(h, h.parent_queue.popleft(), budget=2))
        assert h.events_of(ev.KeysPinned)
        # the pending keys are written; one more pin fits, the other does not
        h.cache.pending.clear()
        h.cache.stored.update({key(1): 1, key(2): 2})
        h.advance(0.01)
        h.tick()
        h.feed(serve_with_budget(h, h.parent_queue.popleft(), budget=1))
        (refused,) = h.events_of(ev.KeysRefused)
        assert refused.keys == (key(2),)  # type: ignore[attr-defined]
        (resp,) = h.sent_of(wire.LookupResp)
        assert resp.hits == (True, True, False)  # type: ignore[attr-defined]
        assert resp.refused == (False, False, True)  # type: ignore[attr-defined]
        assert sorted(h.cache.pins.values()) == [(key(0),), (key(1),)]

    def test_a_refused_fetch_fails_its_round_and_releases_its_pins(self) -> None:
        h = stocked(1, 2)
        h.lookup(key(1), key(2))
        (job,) = h.cache.pins
        h.feed(verdict(fetch_msg([key(1), key(2)]), Quota.FETCH_ROUNDS))
        kinds = h.kinds()
        assert kinds[-4:] == ["FetchRefused", "PinReleased", "TransferDoneSent", "Closed"]
        assert h.transfers == {}  # nothing written
        (done,) = h.sent_of(wire.TransferDone)
        assert isinstance(done, wire.TransferDone)
        assert not done.success
        assert h.released[job] == 1
        assert h.release_success[job] is False
        assert h.state.phase is ProducerPhase.CLOSED

    def test_a_refused_fetch_without_a_lookup_fails_too(self) -> None:
        h = ProducerHarness()
        h.feed(verdict(fetch_msg([key(1)], round_seq=3), Quota.OPEN_REQUESTS))
        (done,) = h.sent_of(wire.TransferDone)
        assert not done.success  # type: ignore[attr-defined]
        assert h.state.phase is ProducerPhase.CLOSED

    def test_the_closing_empty_fetch_is_never_refused(self) -> None:
        h = stocked(1)
        h.lookup(key(1))
        h.feed(verdict(fetch_msg([], round_seq=0), Quota.FETCH_ROUNDS))
        (closed,) = h.events_of(ev.Closed)
        assert isinstance(closed, ev.Closed)
        assert closed.requested_round == 0  # the peer's close, in the Closed itself
        assert not h.events_of(ev.FetchRefused)
        assert h.pinned_jobs() == set()
        assert h.state.phase is ProducerPhase.CLOSED

    def test_an_abort_of_a_skipped_looked_up_round_releases_its_pins_at_once(self) -> None:
        # Found by the producer machine with refused fetches: a later round's
        # fetch skips round 0, whose abort was then acked with its pin left
        # held until the 30 s pin timeout.
        h = stocked(1, 2)
        h.lookup(key(1), round_seq=0)
        (job,) = h.cache.pins
        h.feed(verdict(fetch_msg([key(2)], round_seq=1), Quota.FETCH_ROUNDS))
        assert h.released[job] == 0
        h.abort(round_seq=0)
        assert h.released[job] == 1
        assert [m.round_seq for m in h.sent_of(wire.AbortAck)] == [0]  # type: ignore[attr-defined]
        assert h.state.phase is ProducerPhase.CLOSED


def fx_lookup_type() -> type:
    from p2pactor.core.effects import ParentLookup  # noqa: PLC0415

    return ParentLookup


def serve_with_budget(h: ProducerHarness, request: object, budget: int) -> inp.ParentAnswer:
    """Serve a parent lookup against the harness's cache as the node does under a quota."""
    from p2pactor.core.effects import ParentLookup  # noqa: PLC0415
    from p2pactor.runtime.serving import serve_parent_request  # noqa: PLC0415

    assert isinstance(request, ParentLookup)

    class Adapter:
        def on_new_request(self, context: str) -> None:
            h.cache.opened.append(context)

        def lookup(self, k: bytes, context: str) -> inp.LookupResult:
            del context
            return h.cache.lookup(k)

        def create_store_job(self, keys: Sequence[bytes], context: str) -> inp.Pin:
            del context
            job = h.cache.next_job
            h.cache.next_job += 1
            h.cache.pins[job] = tuple(keys)
            return inp.Pin(job, tuple(keys), tuple(h.cache.stored[k] for k in keys))

        def on_request_finished(self, context: str) -> None:
            h.cache.closed.append(context)

        def release_job(self, job_id: int, *, success: bool) -> None:
            raise AssertionError("not used here")

    return serve_parent_request(
        Adapter(),  # type: ignore[arg-type]
        request,
        h.now,
        pin_budget=budget,
        refusal="over budget",
    )


# --- the ledger ---------------------------------------------------------------------------


def producer(peer: str = PEER, kv: str = KV) -> ActorId:
    return ActorId(Role.PRODUCER, peer, kv)


@attrs.define
class Ledgered(ProducerHarness):
    """A producer request stepped as the runtime steps it: admitted, stepped, observed."""

    ledger: QuotaLedger = attrs.field(kw_only=True)
    handle: str = attrs.field(default="a", kw_only=True)

    def __attrs_post_init__(self) -> None:
        self.cache.stored = {key(i): 10 + i for i in range(8)}
        self.ledger.open_request(PEER, self.handle)

    def feed(self, event_input: ProducerInput) -> tuple[ev.ProducerEvent, ...]:
        if isinstance(event_input, wire.Lookup | wire.Fetch):
            event_input = self.ledger.admit(self.handle, event_input)
        auto, self.auto_serve = self.auto_serve, False
        try:
            events = super().feed(event_input)
        finally:
            self.auto_serve = auto
        self.ledger.observe(self.handle, events, self.state, self.now)
        if auto:
            self.serve()
        return events


class TestLedger:
    def test_defaults_and_validation(self) -> None:
        assert DEFAULT_QUOTAS.pinned_blocks_limit(4000) == 1000
        assert DEFAULT_QUOTAS.pinned_blocks_limit(2) == 1  # never zero
        assert PeerQuotas(max_pinned_blocks=7).pinned_blocks_limit(4000) == 7
        assert PeerQuotas(max_pinned_blocks=0).pinned_blocks_limit(4000) == 0
        for bad in (
            {"max_open_lookups": 0},
            {"max_keys_per_lookup": -1},
            {"max_fetch_rounds": 1.5},
            {"max_open_requests": True},
            {"max_pinned_blocks": -1},
            {"pinned_blocks_fraction": 0.0},
            {"pinned_blocks_fraction": 1.5},
            {"log_interval": -1.0},
        ):
            with pytest.raises(ConfigError):
                PeerQuotas(**bad)  # type: ignore[arg-type]
        assert NodeConfig().quotas == DEFAULT_QUOTAS
        assert NodeConfig(quotas=PeerQuotas(max_fetch_rounds=3)).quotas.max_fetch_rounds == 3

    def test_open_requests_over_the_quota_refuse_everything_but_the_close(self) -> None:
        ledger = QuotaLedger(PeerQuotas(max_open_requests=2), 100)
        assert ledger.open_request(PEER, "r1")
        assert ledger.open_request(PEER, "r2")
        assert not ledger.open_request(PEER, "r3")
        look = lookup_msg(key(1), kv="r3")
        out = ledger.admit("r3", look)
        assert isinstance(out, inp.OverQuota)
        assert out.quota is Quota.OPEN_REQUESTS
        assert "2 requests open" in out.reason
        fetch = fetch_msg([key(1)], kv="r3")
        refused = ledger.admit("r3", fetch)
        assert isinstance(refused, inp.OverQuota)
        assert refused.quota is Quota.OPEN_REQUESTS
        close = fetch_msg([], kv="r3")
        assert ledger.admit("r3", close) is close
        assert ledger.admit("r1", look) is look
        assert ledger.usage(PEER).open_requests == 3
        ledger.forget("r3")
        ledger.forget("r3")  # idempotent
        assert ledger.usage(PEER).open_requests == 2
        assert ledger.open_request(PEER, "r4") is False
        for handle in ["r1", "r2", "r4"]:
            ledger.forget(handle)
        assert ledger.usage(PEER).holds_nothing

    def test_open_lookups_are_counted_from_the_state_until_answered_or_dropped(self) -> None:
        ledger = QuotaLedger(PeerQuotas(max_open_lookups=2), 100)
        h = Ledgered(ledger=ledger, auto_serve=False)
        h.cache.pending = {key(10), key(11)}  # HIT_PENDING: the lookups stay open
        h.lookup(key(10))
        h.serve()
        h.advance(1.0)
        received = h.feed(lookup_msg(key(11)))
        h.serve()
        assert ledger.usage(PEER).open_lookups == 2
        assert [type(e) for e in received] == [ev.LookupReceived]
        ledger.observe("a", received, h.state, h.now)  # seen twice: counted once
        assert ledger.usage(PEER).open_lookups == 2
        out = ledger.admit("a", lookup_msg(key(9), kv="a"))
        assert isinstance(out, inp.OverQuota)
        assert out.quota is Quota.OPEN_LOOKUPS
        # Lookup 0 is answered at its deadline while the parent still has its
        # poll: it stays in the state, answered, and counts no more.
        h.tick()
        assert h.parent_queue
        h.advance(4.5)
        h.tick()
        assert [e.lookup_id for e in h.events_of(ev.LookupAnswered)] == [0]  # type: ignore[attr-defined]
        assert h.state.lookups[0].answered
        assert ledger.usage(PEER).open_lookups == 1
        look = lookup_msg(key(9), kv="a")
        assert ledger.admit("a", look) is look
        h.fetch([], [], round_seq=1)  # drops both: the drop after the answer is a no-op
        assert len(h.events_of(ev.LookupDropped)) == 2
        assert ledger.usage(PEER).open_lookups == 0
        assert ledger.usage(PEER).open_requests == 1
        h.serve()
        assert h.state.phase is ProducerPhase.CLOSED
        assert ledger.usage(PEER).holds_nothing

    def test_keys_per_lookup_admits_a_prefix(self) -> None:
        ledger = QuotaLedger(PeerQuotas(max_keys_per_lookup=3), 100)
        ledger.open_request(PEER, "a")
        short = lookup_msg(*(key(i) for i in range(3)), kv="a")
        assert ledger.admit("a", short) is short
        out = ledger.admit("a", lookup_msg(*(key(i) for i in range(5)), kv="a"))
        assert isinstance(out, inp.OverQuota)
        assert (out.quota, out.admit) == (Quota.KEYS_PER_LOOKUP, 3)

    def test_fetch_rounds_are_counted_until_their_round_ends(self) -> None:
        ledger = QuotaLedger(PeerQuotas(max_fetch_rounds=1), 100)
        h = Ledgered(ledger=ledger)
        ledger.open_request(PEER, "b")
        h.lookup(key(1), round_seq=0)
        h.lookup(key(2), round_seq=1)  # pinned: keeps the request open past round 0
        h.fetch([key(1)], [0], round_seq=0)
        assert ledger.usage(PEER).fetch_rounds == 1
        out = ledger.admit("b", fetch_msg([key(1)], kv="b"))
        assert isinstance(out, inp.OverQuota)
        assert out.quota is Quota.FETCH_ROUNDS
        h.complete_all()
        assert isinstance(h.log[-1], ev.TransferDoneSent)
        assert ledger.usage(PEER).fetch_rounds == 0
        assert ledger.usage(PEER).open_requests == 2
        fetch = fetch_msg([key(1)], kv="b")
        assert ledger.admit("b", fetch) is fetch

    def test_pins_count_per_peer_and_release_once(self) -> None:
        ledger = QuotaLedger(PeerQuotas(max_pinned_blocks=5), 100)
        other = "10.0.0.3:5710"
        assert ledger.pin_budget(PEER) == 5
        ledger.pinned(PEER, 1, 3)
        ledger.pinned(PEER, 2, 2)
        assert ledger.pin_budget(PEER) == 0
        assert ledger.pin_budget(other) == 5  # another peer is not affected
        assert "5 blocks pinned" in ledger.pin_refusal(PEER)
        ledger.released(1)
        ledger.released(1)  # twice: ignored
        ledger.released(99)  # a store job, never counted: ignored
        usage = ledger.usage(PEER)
        assert (usage.pinned_blocks, usage.peak_pinned_blocks) == (2, 5)
        ledger.released(2)
        assert ledger.usage(PEER).holds_nothing
        assert ledger.usage("stranger:1") == PeerUsage()
        assert set(ledger.usages()) == {PEER}

    def test_refusals_are_counted_and_logged_at_most_once_per_interval(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        ledger = QuotaLedger(PeerQuotas(log_interval=10.0), 100)
        h = Ledgered(ledger=ledger)
        h.lookup(key(1), round_seq=0)  # pinned: the request stays open through its refusals
        caplog.set_level(logging.WARNING, logger="p2pactor.quotas")

        def refuse(round_seq: int, now: float) -> None:
            h.now = now
            events = h.feed(
                inp.OverQuota(
                    message=lookup_msg(key(1), round_seq=round_seq),
                    quota=Quota.OPEN_LOOKUPS,
                    reason="full",
                )
            )
            assert [type(e) for e in events] == [ev.LookupRefused]

        for t in range(5):
            refuse(t + 1, float(t))
        refuse(6, 10.5)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2
        assert "refused 10.0.0.2:5710 over its open_lookups quota: full" in lines[0]
        assert "(4 more refusals of this kind since the last message)" in lines[1]
        assert ledger.usage(PEER).refusals == {"open_lookups": 6}

    def test_quotas_from_the_environment(self) -> None:
        assert PeerQuotas.from_env({}) is None
        env = {
            "P2PACTOR_QUOTA_PINNED_BLOCKS": "100",
            "P2PACTOR_QUOTA_OPEN_LOOKUPS": "7",
            "P2PACTOR_QUOTA_KEYS_PER_LOOKUP": "9",
            "P2PACTOR_QUOTA_FETCH_ROUNDS": "3",
            "P2PACTOR_QUOTA_OPEN_REQUESTS": "11",
            "P2PACTOR_QUOTA_PINNED_FRACTION": "0.5",
            "P2PACTOR_QUOTA_ROUNDS_PER_REQUEST": "5",
        }
        assert PeerQuotas.from_env(env) == PeerQuotas(
            max_pinned_blocks=100,
            pinned_blocks_fraction=0.5,
            max_open_lookups=7,
            max_keys_per_lookup=9,
            max_fetch_rounds=3,
            max_open_requests=11,
            max_rounds_per_request=5,
        )
        assert NodeConfig.from_env(env).quotas.max_open_requests == 11
        assert NodeConfig.from_env({}).quotas == DEFAULT_QUOTAS
        with pytest.raises(ConfigError, match="P2PACTOR_QUOTA_OPEN_LOOKUPS='many'"):
            PeerQuotas.from_env({"P2PACTOR_QUOTA_OPEN_LOOKUPS": "many"})
        with pytest.raises(ConfigError, match="P2PACTOR_QUOTA_FETCH_ROUNDS"):
            NodeConfig.from_env({"P2PACTOR_QUOTA_FETCH_ROUNDS": "0"})

    def test_usage_prints_as_json(self) -> None:
        usage = PeerUsage(pinned_blocks=2, peak_pinned_blocks=5, refusals={"fetch_rounds": 1})
        assert json.loads(usage.to_json()) == {
            "pinned_blocks": 2,
            "peak_pinned_blocks": 5,
            "open_lookups": 0,
            "fetch_rounds": 0,
            "open_requests": 0,
            "refusals": {"fetch_rounds": 1},
        }

    def test_idle_peers_are_forgotten_past_a_bound(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr("p2pactor.runtime.quotas._REMEMBERED_PEERS", 3)
        ledger = QuotaLedger(DEFAULT_QUOTAS, 100)
        ledger.open_request("holds-a-request:1", "r")
        ledger.pinned("holds-a-pin:1", 1, 2)
        ledger.pinned("idle:1", 2, 1)
        ledger.released(2)
        ledger.pinned("newcomer:1", 3, 1)
        assert set(ledger.usages()) == {"holds-a-request:1", "holds-a-pin:1", "newcomer:1"}

    def test_unknown_handles_are_let_through(self) -> None:
        ledger = QuotaLedger(DEFAULT_QUOTAS, 100)
        look = lookup_msg(key(1))
        assert ledger.admit("consumer", look) is look
        ledger.observe("consumer", [], ProducerState.new(producer()), 0.0)
        ledger.forget("consumer")


# --- nodes on the in-memory transports ----------------------------------------------------


def quotas(**limits: object) -> PeerQuotas:
    return PeerQuotas(**limits)  # type: ignore[arg-type]


async def settle(condition: object, limit: float = 60.0) -> None:
    """Wait (on trio's clock) until ``condition()`` holds."""
    with trio.fail_after(limit):
        while not condition():  # type: ignore[operator]  # noqa: ASYNC110 - no event to wait on
            await trio.sleep(0.01)


def refusals_replayed(events: Sequence[ev.AnyEvent]) -> dict[str, int]:
    """Replay a node's log with the invariant checks on; return its quota refusals."""
    replayer = Replayer(check=True)
    for event in events:
        replayer.feed("node", event)
    replayer.end()
    assert replayer.violations == []
    return dict(replayer.summary().quota_refusals)


def held_by(node: Node, peer: str) -> PeerUsage:
    return node.peer_usage(peer)


class TestNodes:
    async def test_counts_return_to_zero_after_normal_completion(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b", quotas=quotas(max_pinned_blocks=4)) as cluster:
            a, b = cluster["a"], cluster["b"]
            keys = [key(i) for i in range(4)]
            b.store(*keys)
            for round_ in range(3):
                kv = f"r{round_}"
                assert await a.node.lookup(b.id, kv, keys) == [HIT] * 4
                blocks = a.cache.allocate(4)
                result = await a.node.fetch(b.id, kv, keys, blocks)
                assert result.success, result.reason
                for k, block in zip(keys, blocks, strict=True):
                    assert bytes(a.cache.memory[block * 64 : (block + 1) * 64]) == block_bytes(k)
                a.cache.free(blocks)
                a.node.finish(kv)
            await settle(lambda: b.node.peer_usage(a.id).holds_nothing)
            usage = b.node.peer_usage(a.id)
            assert usage.peak_pinned_blocks == 4
            assert usage.refusals == {}
            assert b.cache.held_jobs() == set()
            assert refusals_replayed(b.log.recent()) == {}

    async def test_pinned_blocks_quota_is_per_peer_and_pins_a_prefix(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b", "c", quotas=quotas(max_pinned_blocks=3)) as cluster:
            a, b, c = cluster["a"], cluster["b"], cluster["c"]
            keys = [key(i) for i in range(6)]
            b.store(*keys)
            # a looks up and never fetches: its first 3 hits are pinned, the rest MISS
            assert await a.node.lookup(b.id, "greedy-1", keys) == [HIT] * 3 + [MISS] * 3
            assert await a.node.lookup(b.id, "greedy-2", keys) == [MISS] * 6
            usage = b.node.peer_usage(a.id)
            assert (usage.pinned_blocks, usage.peak_pinned_blocks) == (3, 3)
            assert usage.refusals == {"pinned_blocks": 2}
            assert b.cache.pinned() == 3
            # c is not affected: it gets its own quota
            assert await c.node.lookup(b.id, "honest", keys[:3]) == [HIT] * 3
            blocks = c.cache.allocate(3)
            result = await c.node.fetch(b.id, "honest", keys[:3], blocks)
            assert result.success, result.reason
            for k, block in zip(keys[:3], blocks, strict=True):
                c.cache.commit(k, block)
                assert c.cache.read(k) == block_bytes(k)
            c.node.finish("honest")
            # a's pins are released when it fetches (or at the pin timeout)
            blocks = a.cache.allocate(3)
            result = await a.node.fetch(b.id, "greedy-1", keys[:3], blocks)
            assert result.success, result.reason
            a.cache.free(blocks)
            assert await a.node.lookup(b.id, "greedy-3", keys[3:]) == [HIT] * 3
            a.node.finish("greedy-1")
            a.node.finish("greedy-2")
            a.node.finish("greedy-3")
            await settle(lambda: b.node.peer_usage(a.id).holds_nothing)
            await settle(lambda: b.node.peer_usage(c.id).holds_nothing)
            assert b.node.peer_usage(c.id).refusals == {}
            assert b.node.peer_usage(a.id).peak_pinned_blocks == 3
            assert b.cache.held_jobs() == set()
            assert refusals_replayed(b.log.recent()) == {"pinned_blocks": 2}

    async def test_unfetched_pins_expire_and_free_the_quota(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b", quotas=quotas(max_pinned_blocks=2)) as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1), key(2))
            assert await a.node.lookup(b.id, "r1", [key(1), key(2)]) == [HIT, HIT]
            assert await a.node.lookup(b.id, "r2", [key(1)]) == [MISS]
            await trio.sleep(31)  # the pin timeout
            assert b.node.peer_usage(a.id).pinned_blocks == 0
            assert await a.node.lookup(b.id, "r3", [key(1)]) == [HIT]

    async def test_pending_keys_that_resolve_later_count_against_the_pin_quota(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b", quotas=quotas(max_pinned_blocks=2)) as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1))
            for k in (key(2), key(3)):
                b.cache.mark_pending(k)
            async with trio.open_nursery() as nursery:
                answers: list[list[inp.LookupResult]] = []

                async def ask() -> None:
                    answers.append(await a.node.lookup(b.id, "r", [key(1), key(2), key(3)]))

                nursery.start_soon(ask)
                await trio.sleep(1)
                assert answers == []  # keys 2 and 3 are still being written
                b.store(key(2), key(3))
            assert answers == [[HIT, HIT, MISS]]
            usage = b.node.peer_usage(a.id)
            assert usage.peak_pinned_blocks == 2
            assert usage.refusals == {"pinned_blocks": 1}
            a.node.finish("r")
            await settle(lambda: b.node.peer_usage(a.id).holds_nothing)
            assert b.cache.held_jobs() == set()

    async def test_open_lookups_quota_answers_the_extra_lookup_at_once(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer(quotas=quotas(max_open_lookups=2)) as (node, cache, peer):
            cache.mark_pending(key(1))  # lookups of it stay open for 5 s
            await peer.handshake_as_client()
            start = trio.current_time()
            for kv in ("p1", "p2", "p3"):
                await peer.send(wire.Lookup(kv_request_id=kv, keys=(key(1),), round_seq=0))
            resp = await peer.expect(wire.LookupResp)
            assert isinstance(resp, wire.LookupResp)
            assert (resp.kv_request_id, resp.hits) == ("p3", (False,))
            assert trio.current_time() - start < 0.1
            assert node.peer_usage(peer.peer_id).open_lookups == 2
            late = [await peer.expect(wire.LookupResp) for _ in range(2)]
            assert {m.kv_request_id for m in late} == {"p1", "p2"}  # type: ignore[attr-defined]
            assert trio.current_time() - start == pytest.approx(5.0, abs=0.1)
            usage = node.peer_usage(peer.peer_id)
            assert usage.open_lookups == 0
            assert usage.refusals == {"open_lookups": 1}
            for kv in ("p1", "p2"):
                await peer.send(fetch_msg([], kv=kv))
            await settle(lambda: node.peer_usage(peer.peer_id).holds_nothing)
            assert cache.held_jobs() == set()
            assert cache.opened == set()

    async def test_keys_per_lookup_quota_serves_the_prefix_byte_for_byte(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer(quotas=quotas(max_keys_per_lookup=2)) as (node, cache, peer):
            keys = [key(i) for i in range(4)]
            for k in keys:
                cache.store(k, block_bytes(k))
            await peer.handshake_as_client()
            await peer.send(wire.Lookup(kv_request_id="r", keys=tuple(keys), round_seq=0))
            resp = await peer.expect(wire.LookupResp)
            assert resp.hits == (True, True, False, False)  # type: ignore[attr-defined]
            await peer.send(
                wire.Fetch(kv_request_id="r", keys=keys[:2], block_indexes=(5, 6), round_seq=0)
            )
            done = await peer.expect(wire.TransferDone)
            assert done.success  # type: ignore[attr-defined]
            assert bytes(peer.memory[5 * 64 : 7 * 64]) == block_bytes(keys[0]) + block_bytes(
                keys[1]
            )
            await settle(lambda: node.peer_usage(peer.peer_id).holds_nothing)
            assert node.peer_usage(peer.peer_id).refusals == {"keys_per_lookup": 1}
            assert cache.held_jobs() == set()

    async def test_a_refused_fetch_fails_and_releases_its_pins(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer(quotas=quotas(max_fetch_rounds=1)) as (node, cache, peer):
            for i in (1, 2):
                cache.store(key(i), block_bytes(key(i)))
            await peer.handshake_as_client()
            for kv, k in (("r1", key(1)), ("r2", key(2))):
                await peer.send(wire.Lookup(kv_request_id=kv, keys=(k,), round_seq=0))
                await peer.expect(wire.LookupResp)
            assert cache.pinned() == 2
            plane = peer.data._plane
            plane.hold_writes()  # r1's write stays in flight
            await peer.send(
                wire.Fetch(kv_request_id="r1", keys=(key(1),), block_indexes=(1,), round_seq=0)
            )
            await settle(lambda: plane.held == 1)
            await peer.send(
                wire.Fetch(kv_request_id="r2", keys=(key(2),), block_indexes=(2,), round_seq=0)
            )
            refused = await peer.expect(wire.TransferDone)
            assert isinstance(refused, wire.TransferDone)
            assert (refused.kv_request_id, refused.success) == ("r2", False)
            assert cache.pinned() == 1  # r2's pin went with its round
            assert bytes(peer.memory[2 * 64 : 3 * 64]) == bytes(64)  # nothing written
            plane.release_writes()
            served = await peer.expect(wire.TransferDone)
            assert (served.kv_request_id, served.success) == ("r1", True)  # type: ignore[attr-defined]
            assert bytes(peer.memory[64:128]) == block_bytes(key(1))
            await settle(lambda: node.peer_usage(peer.peer_id).holds_nothing)
            assert node.peer_usage(peer.peer_id).refusals == {"fetch_rounds": 1}
            assert cache.held_jobs() == set()
            assert cache.opened == set()

    async def test_open_requests_quota_refuses_new_requests_until_one_closes(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer(quotas=quotas(max_open_requests=2)) as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            for kv in ("r1", "r2", "r3"):
                await peer.send(wire.Lookup(kv_request_id=kv, keys=(key(1),), round_seq=0))
            hits = {}
            for _ in range(3):
                resp = await peer.expect(wire.LookupResp)
                hits[resp.kv_request_id] = resp.hits  # type: ignore[attr-defined]
            assert hits == {"r1": (True,), "r2": (True,), "r3": (False,)}
            # a fetch under a refused request fails at once
            await peer.send(
                wire.Fetch(kv_request_id="r4", keys=(key(1),), block_indexes=(0,), round_seq=0)
            )
            done = await peer.expect(wire.TransferDone)
            assert (done.kv_request_id, done.success) == ("r4", False)  # type: ignore[attr-defined]
            await peer.send(fetch_msg([], kv="r1"))  # r1 closes: room for one more
            await settle(lambda: node.peer_usage(peer.peer_id).open_requests == 1)
            await peer.send(wire.Lookup(kv_request_id="r5", keys=(key(1),), round_seq=0))
            resp = await peer.expect(wire.LookupResp)
            assert (resp.kv_request_id, resp.hits) == ("r5", (True,))  # type: ignore[attr-defined]
            for kv in ("r2", "r5"):
                await peer.send(fetch_msg([], kv=kv))
            await settle(lambda: node.peer_usage(peer.peer_id).holds_nothing)
            assert node.peer_usage(peer.peer_id).refusals == {"open_requests": 2}
            assert cache.held_jobs() == set()

    async def test_a_dead_peer_holds_nothing_and_every_pin_is_released(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer(quotas=quotas(max_pinned_blocks=3, max_open_lookups=3)) as (
            node,
            cache,
            peer,
        ):
            for i in range(4):
                cache.store(key(i), block_bytes(key(i)))
            cache.mark_pending(key(9))
            await peer.handshake_as_client()
            # pins, a refused pin, an open lookup and a write in flight
            await peer.send(wire.Lookup(kv_request_id="r1", keys=(key(0), key(1)), round_seq=0))
            await peer.send(wire.Lookup(kv_request_id="r2", keys=(key(2), key(3)), round_seq=0))
            await peer.send(wire.Lookup(kv_request_id="r3", keys=(key(9),), round_seq=0))
            for _ in range(2):
                await peer.expect(wire.LookupResp)
            plane = peer.data._plane
            plane.hold_writes()
            await peer.send(
                wire.Fetch(kv_request_id="r1", keys=(key(0),), block_indexes=(0,), round_seq=0)
            )
            await settle(lambda: plane.held == 1)
            usage = node.peer_usage(peer.peer_id)
            assert (usage.pinned_blocks, usage.open_lookups, usage.fetch_rounds) == (3, 1, 1)
            assert usage.open_requests == 3
            peer.transport.network.kill(peer.peer_id)
            await settle(node.peers.closed_sessions)
            plane.release_writes()
            await settle(lambda: node.peer_usage(peer.peer_id).holds_nothing)
            await settle(lambda: cache.held_jobs() == set())
            assert cache.opened == set()
            assert node.peer_usage(peer.peer_id).peak_pinned_blocks == 3

    async def test_a_flood_of_request_ids_does_not_pile_up_ended_actors(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer(quotas=quotas(max_open_requests=8)) as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            for i in range(3000):
                await peer.send(wire.Lookup(kv_request_id=f"r{i}", keys=(key(1),), round_seq=0))
                if i % 100 == 99:
                    for _ in range(100):
                        await peer.expect(wire.LookupResp)
            assert len(node.stores._bound) < 1100  # the 8 open ones and at most 1024 ended
            assert node.peer_usage(peer.peer_id).open_requests == 8
            for i in range(8):
                await peer.send(fetch_msg([], kv=f"r{i}"))
            await settle(lambda: node.peer_usage(peer.peer_id).holds_nothing)

    async def test_a_refused_peer_keeps_its_session(self, autojump_clock: trio.abc.Clock) -> None:
        async with node_and_peer(quotas=quotas(max_open_requests=1)) as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            for i in range(50):
                await peer.send(wire.Lookup(kv_request_id=f"r{i}", keys=(key(1),), round_seq=0))
            for _ in range(50):
                await peer.expect(wire.LookupResp)
            assert node.peers.session(peer.peer_id) is not None
            assert node.peer_usage(peer.peer_id).refusals == {"open_requests": 49}


# --- real transports: a hostile raw peer floods, an honest node fetches --------------------

FLOOD_PEER = "tests.flood_peer"
"""The hostile raw peer, the bench's sockets flooding lookups (``python -m``)."""
REAL_BLOCK_LEN = 4096
REAL_BLOCKS = 64
REAL_QUOTA = 8


async def test_a_flooding_peer_never_pins_more_than_its_quota_over_zmq_and_nixl() -> None:
    """Real ZeroMQ and NIXL; the hostile peer is a raw pyzmq process of its own."""
    try:
        import_nixl()
    except DataPlaneError as exc:  # NIXL's wheel, not our code: a failure under CI=1
        pytest.skip(f"no NIXL wheel imports: {exc}")
    seed = "flood-test-seed"
    keys = preload_keys(seed, REAL_BLOCKS)
    victim_pool = bytearray(REAL_BLOCKS * REAL_BLOCK_LEN)
    victim_cache = EmbeddedCache(REAL_BLOCKS, REAL_BLOCK_LEN, memory=memoryview(victim_pool))
    for k in keys:
        victim_cache.store(k, real_block(k, REAL_BLOCK_LEN))
    honest_pool = bytearray(REAL_BLOCKS * REAL_BLOCK_LEN)
    honest_cache = EmbeddedCache(REAL_BLOCKS, REAL_BLOCK_LEN, memory=memoryview(honest_pool))
    settings = {"num_blocks": REAL_BLOCKS, "block_len": REAL_BLOCK_LEN, "hash_seed": seed}
    with trio.fail_after(240):
        async with (
            open_zmq_transport("127.0.0.1:0", port=0) as zv,
            open_zmq_transport("127.0.0.1:0", port=0) as zh,
            open_nixl_transport(victim_pool, REAL_BLOCK_LEN, name="victim") as dv,
            open_nixl_transport(honest_pool, REAL_BLOCK_LEN, name="honest") as dh,
        ):
            victim_cfg = NodeConfig(
                host="127.0.0.1",
                port=zv.port,
                quotas=PeerQuotas(max_pinned_blocks=REAL_QUOTA),
                **settings,  # type: ignore[arg-type]
            )
            honest_cfg = NodeConfig(host="127.0.0.1", port=zh.port, **settings)  # type: ignore[arg-type]
            async with (
                open_node(victim_cfg, control=zv, data=dv, parent=victim_cache) as victim,
                open_node(honest_cfg, control=zh, data=dh, parent=honest_cache) as honest,
            ):
                flooder = await trio.lowlevel.open_process(
                    [
                        sys.executable,
                        "-m",
                        FLOOD_PEER,
                        f"--victim={victim.node_id}",
                        f"--hash-seed={seed}",
                        f"--block-len={REAL_BLOCK_LEN}",
                        f"--preload={REAL_BLOCKS}",
                        "--phase=real:1500",
                        "--phase=random:1500",
                        "--phase=rounds:500",
                        "--keys=16",
                        "--window=128",
                    ],
                    stdout=subprocess.PIPE,
                    env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
                    cwd=Path(__file__).parent.parent,  # where ``tests`` imports from
                )
                lines: list[str] = []
                fetched = 0

                async def read_flooder() -> None:
                    assert flooder.stdout is not None
                    buffer = b""
                    async for chunk in flooder.stdout:
                        buffer += chunk
                    lines.extend(buffer.decode().splitlines())
                    await flooder.wait()

                async def honest_workload() -> None:
                    nonlocal fetched
                    i = 0
                    while flooder.returncode is None or i < 5:
                        kv = f"honest-{i}"
                        wanted = keys[(i * 8) % 56 : (i * 8) % 56 + 8]
                        answers = await honest.lookup(victim.node_id, kv, wanted)
                        assert answers == [HIT] * 8, answers
                        blocks = honest_cache.allocate(8)
                        result = await honest.fetch(victim.node_id, kv, wanted, blocks)
                        assert result.success, result.reason
                        for k, block in zip(wanted, blocks, strict=True):
                            got = honest_pool[block * REAL_BLOCK_LEN : (block + 1) * REAL_BLOCK_LEN]
                            assert got == real_block(k, REAL_BLOCK_LEN)
                        honest_cache.free(blocks)
                        honest.finish(kv)
                        fetched += 8
                        i += 1

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_flooder)
                    nursery.start_soon(honest_workload)
                assert flooder.returncode == 0, lines
                ready = [line for line in lines if line.startswith("READY ")]
                phases = [json.loads(line[5:]) for line in lines if line.startswith("DONE ")]
                assert len(ready) == 1
                assert [p["answered"] for p in phases] == [1500, 1500, 500]
                hostile = ready[0].split()[1]
                usage = victim.peer_usage(hostile)
                assert 0 < usage.peak_pinned_blocks <= REAL_QUOTA
                assert usage.refusals.get("pinned_blocks", 0) > 0
                assert usage.refusals.get("open_requests", 0) == 0
                # one request, a new round per lookup: 16 rounds held, the rest refused
                assert usage.refusals.get("rounds_per_request", 0) == 500 - 16
                assert victim.peer_usage(honest.node_id).refusals == {}
                assert fetched >= 40
                await settle(
                    lambda: (
                        victim.peer_usage(hostile).holds_nothing
                        and victim.peer_usage(honest.node_id).holds_nothing
                    )
                )
                assert victim_cache.held_jobs() == set()
                assert victim_cache.opened == set()


class TestRoundsPerRequest:
    def test_the_ledger_counts_rounds_held_from_the_state(self) -> None:
        ledger = QuotaLedger(PeerQuotas(max_rounds_per_request=2), 100)
        h = Ledgered(ledger=ledger)
        for r in range(2):
            h.lookup(key(1), round_seq=r)
        same_round = lookup_msg(key(2), round_seq=1, kv="a")
        assert ledger.admit("a", same_round) is same_round
        out = ledger.admit("a", lookup_msg(key(2), round_seq=2, kv="a"))
        assert isinstance(out, inp.OverQuota)
        assert out.quota is Quota.ROUNDS_PER_REQUEST
        assert "already holds 2 rounds" in out.reason
        fetch = ledger.admit("a", fetch_msg([key(1)], round_seq=5, kv="a"))
        assert isinstance(fetch, inp.OverQuota)
        h.fetch([key(1)], [0], round_seq=0)
        h.complete_all()  # ends round 0; round 1's pin keeps the request open
        assert isinstance(h.log[-1], ev.TransferDoneSent)
        again = lookup_msg(key(2), round_seq=2, kv="a")
        assert ledger.admit("a", again) is again

    async def test_lookups_for_ever_new_rounds_of_one_request_are_refused(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer(quotas=quotas(max_rounds_per_request=4)) as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            for r in range(10):
                await peer.send(wire.Lookup(kv_request_id="one", keys=(key(1),), round_seq=r))
            hits = []
            for _ in range(10):
                resp = await peer.expect(wire.LookupResp)
                hits.append(resp.hits)  # type: ignore[attr-defined]
            # refused lookups are answered at once, maybe before admitted ones
            assert sorted(hits) == [(False,)] * 6 + [(True,)] * 4
            assert node.peer_usage(peer.peer_id).refusals == {"rounds_per_request": 6}
            # the rounds it holds are still served (0..2 stay until the request closes)
            await peer.send(
                wire.Fetch(kv_request_id="one", keys=(key(1),), block_indexes=(2,), round_seq=3)
            )
            done = await peer.expect(wire.TransferDone)
            assert done.success  # type: ignore[attr-defined]
            assert bytes(peer.memory[2 * 64 : 3 * 64]) == block_bytes(key(1))
            await peer.send(fetch_msg([], kv="one", round_seq=4))
            await settle(lambda: node.peer_usage(peer.peer_id).holds_nothing)
            assert cache.held_jobs() == set()
