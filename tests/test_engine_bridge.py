"""An engine asking the same keys again, in every order of answers, fetches and scans.

vLLM's scheduler asks its tier about a request's keys every step, in order,
past a RETRY, up to the first MISS (``_maximal_prefix_lookup``), and asks the
first missed key again once the hit run is loaded. These tests make those
calls through the thread-safe half of a node (``lookup_view``/``ask``/``flush``,
what the vLLM adapter calls) and check that every key is answered HIT or
MISS, never RETRY for ever:

* regression tests on two real nodes (in-memory transports, mock clock) for
  the orders that hung: the answer arriving before the engine's next scan,
  then a fetch, then the re-ask of a missed key (a MISS with no new round) or
  of a fetched key evicted locally (asked again, in a new round); keys
  registered and not yet sent when a fetch closed their round; a peer no
  session can be opened with;
* :class:`BridgeMachine`, a hypothesis state machine over the real
  :class:`~p2pactor.runtime.engine.EngineBridge`, real
  :class:`~p2pactor.runtime.actor.RequestActor` consumers on a real
  :class:`~p2pactor.runtime.actor.Runner`, and a scripted peer: the engine's
  scans, the node thread's turns, the peer's answers and writes, local
  evictions and time in any order.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import hypothesis.strategies as st
import trio
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.inputs import LookupResult
from p2pactor.core.timings import DEFAULT_TIMINGS
from p2pactor.runtime.actor import RequestActor, Runner
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.engine import EngineBridge, LoadResult
from tests.cluster import key, open_cluster
from tests.test_node import assert_replay_matches, assert_settled

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def lookups_received(member: Any, kv_request_id: str) -> int:
    """How many lookups of ``kv_request_id`` a node's producers received."""
    return sum(
        1
        for e in member.log.recent()
        if isinstance(e, ev.LookupReceived) and e.actor.kv_request_id == kv_request_id
    )


def scan(node: Any, peer: str, kv: str, keys: Sequence[bytes]) -> list[LookupResult]:
    """One engine scan, as the vLLM adapter makes it: peek each key, ask the RETRYs."""
    answers = [node.lookup_view(peer, kv).answer(k) for k in keys]
    node.ask(peer, kv, [k for k, a in zip(keys, answers, strict=True) if a is RETRY])
    node.flush()
    return answers


async def scan_until_answered(
    node: Any, peer: str, kv: str, keys: Sequence[bytes], steps: int = 50
) -> list[LookupResult]:
    for _ in range(steps):
        answers = scan(node, peer, kv, keys)
        if RETRY not in answers:
            return answers
        await trio.sleep(0.01)
    raise AssertionError(f"{kv}: still RETRY after {steps} engine steps: {answers}")


async def load(member: Any, peer: str, kv: str, job: int, keys: list[bytes]) -> None:
    blocks = member.cache.allocate(len(keys))
    member.node.submit_load(peer, kv, job, keys, blocks)
    with trio.fail_after(60):
        while not (results := member.node.finished_jobs()):  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert results == [LoadResult(job, True, "")]
    for k, block in zip(keys, blocks, strict=True):
        member.cache.commit(k, block)


class TestAskedAgain:
    async def test_a_miss_asked_again_after_the_fetch_is_a_miss_with_no_new_round(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1), key(2))
            keys = [key(1), key(2), key(3), key(4)]
            assert scan(a.node, b.id, "r", keys) == [RETRY] * 4
            await trio.sleep(1)  # answered before the engine's next scan
            assert scan(a.node, b.id, "r", keys) == [HIT, HIT, MISS, MISS]
            await load(a, b.id, "r", 7, [key(1), key(2)])

            # The hit run is local now; vLLM asks from the first missed key.
            assert await scan_until_answered(a.node, b.id, "r", keys[2:]) == [MISS, MISS]
            await trio.sleep(1)
            assert lookups_received(b, "r") == 1
            a.node.finish("r")
            await trio.sleep(1)
        assert_settled(cluster)
        assert_replay_matches(cluster)

    async def test_a_fetched_key_evicted_locally_is_asked_again_in_a_new_round(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1), key(2))
            keys = [key(1), key(2), key(3)]
            assert await scan_until_answered(a.node, b.id, "r", keys) == [HIT, HIT, MISS]
            await load(a, b.id, "r", 7, [key(1), key(2)])

            # The engine evicted what it fetched before it could use it: it
            # asks the whole run again, and the peer is asked again.
            assert await scan_until_answered(a.node, b.id, "r", keys) == [HIT, HIT, MISS]
            assert lookups_received(b, "r") == 2
            a.node.finish("r")
            await trio.sleep(40)  # the unfetched pins expire after 30 s
        assert_settled(cluster)
        assert_replay_matches(cluster)

    async def test_keys_asked_but_unsent_when_a_fetch_closes_the_round_are_asked_again(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1), key(2))
            assert await scan_until_answered(a.node, b.id, "r", [key(1)]) == [HIT]
            # A longer prompt's next keys are asked in the step whose promotion
            # fetches the first: the fetch reaches the actor before the flush.
            a.node.ask(b.id, "r", [key(2)])
            blocks = a.cache.allocate(1)
            a.node.submit_load(b.id, "r", 7, [key(1)], blocks)
            a.node.flush()
            assert await scan_until_answered(a.node, b.id, "r", [key(2)]) == [HIT]
            a.node.finish("r")
            await trio.sleep(40)
        assert_settled(cluster)
        assert_replay_matches(cluster)

    async def test_a_request_whose_peer_gets_no_session_is_a_miss(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b", "c", per_node={"a": {"max_peers": 1}}) as cluster:
            a, b, c = cluster["a"], cluster["b"], cluster["c"]
            b.store(key(1))
            c.store(key(1))
            assert await scan_until_answered(a.node, b.id, "r1", [key(1)]) == [HIT]
            # The peer cap is reached: no session with c, so no answer will
            # ever come from it; the request prefills locally.
            assert await scan_until_answered(a.node, c.id, "r2", [key(1)]) == [MISS]
            a.node.finish("r1")
            a.node.finish("r2")
            await trio.sleep(40)
        assert_settled(cluster)


# --- the state machine -------------------------------------------------------------

PEER = "127.0.0.1:5711"
NOWHERE = "127.0.0.1:5799"  # no session can be opened with it
KEYS = [key(i) for i in range(6)]
REQUESTS = {"r1": (PEER, KEYS[:4]), "r2": (PEER, KEYS[2:]), "r3": (NOWHERE, KEYS[:2])}
MACHINE_SETTINGS = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class EngineSide(EngineBridge):
    """The bridge over real actors and a scripted peer's inbox: what the adapter calls."""

    def __init__(self) -> None:
        super().__init__(
            NodeConfig(
                host="127.0.0.1",
                port=5710,
                num_blocks=16,
                block_len=64,
                engine_inbox=10_000,
                engine_poll_interval=0.001,
            )
        )
        self.now = 0.0
        self.runner = Runner(lambda: self.now)
        self.actors: dict[tuple[str, str], RequestActor] = {}
        self.retired: list[RequestActor] = []
        self.to_peer: list[tuple[RequestActor, wire.Message]] = []
        self.failures: list[Any] = []
        self.missed: dict[ActorId, set[bytes]] = {}  # keys each actor heard MISS for
        self.offered: dict[ActorId, set[bytes]] = {}  # HITs heard since its last fetch

    # what the node's host provides
    def consumer_for(self, peer: str, kv_request_id: str) -> RequestActor | None:
        if peer == NOWHERE:
            return None
        actor = self.actors.get((peer, kv_request_id))
        if actor is None:
            actor = RequestActor(ActorId(Role.CONSUMER, peer, kv_request_id), self, DEFAULT_TIMINGS)
            self.actors[peer, kv_request_id] = actor
        return actor

    def known_consumer(self, peer: str, kv_request_id: str) -> RequestActor | None:
        return self.actors.get((peer, kv_request_id))

    def submit(
        self, actor: RequestActor, job_id: int, keys: tuple[bytes, ...], blocks: tuple[int, ...]
    ) -> None:
        if actor.done:
            self.report_load(job_id, success=False, reason="the request already ended")
            return
        self.runner.deliver(actor, inp.SubmitLoad(job_id=job_id, keys=keys, block_indexes=blocks))

    def report_load(self, job_id: int, *, success: bool, reason: str) -> None:
        self._results.append(LoadResult(job_id, success, reason))

    def finish_request(self, kv_request_id: str) -> None:
        for (peer, kv), actor in list(self.actors.items()):
            if kv == kv_request_id:
                del self.actors[peer, kv]
                self.retired.append(actor)
                self.runner.deliver(actor, inp.Finish())

    # ActorHost
    def admit(self, actor: RequestActor, event_input: Any) -> Any:
        return event_input

    def stepped(
        self, actor: RequestActor, event_input: Any, events: Sequence[ev.AnyEvent] | None
    ) -> None:
        if events is None:
            self.failures.append(event_input)
            return
        missed = self.missed.setdefault(actor.id, set())
        offered = self.offered.setdefault(actor.id, set())
        for event in events:
            if isinstance(event, ev.LookupResp):
                for k, hit in zip(event.keys, event.hits, strict=True):
                    (offered if hit else missed).add(k)
            elif isinstance(event, ev.Probed):
                # A MISS is always safe: a key heard MISS is never asked again.
                assert not missed & set(event.keys), (event, missed)
            for effect in fx.effects_of(event):
                if isinstance(effect, fx.Send):
                    msg = effect.message
                    if isinstance(msg, wire.Fetch) and msg.keys:
                        # A fetch of a key the round did not offer would wait
                        # for a store, as a disaggregated decode's does.
                        assert set(msg.keys) <= offered, (msg.keys, offered)
                        offered.clear()
                    self.to_peer.append((actor, msg))
                elif isinstance(effect, fx.ReportLoad):
                    self.report_load(effect.job_id, success=effect.success, reason=effect.reason)


def bridge_off_thread() -> EngineSide:
    """A bridge whose node thread is another: the machine's calls only hand over.

    It is made inside a trio run on a helper thread that then ends, so every
    call from here appends to its inbox (its wake-ups find no run and do
    nothing); the machine applies the inbox itself (``EngineBridge._apply``)
    whenever it plays the node's thread.
    """
    made: list[EngineSide] = []

    async def make() -> None:
        made.append(EngineSide())

    thread = threading.Thread(target=trio.run, args=(make,))
    thread.start()
    thread.join()
    return made[0]


class Request:
    """One request as vLLM's scheduler and tiering manager keep it."""

    def __init__(self, kv: str, peer: str, keys: list[bytes]) -> None:
        self.kv, self.peer, self.keys = kv, peer, keys
        self.loading: dict[bytes, int] = {}  # promotions in flight: key -> job
        self.promote: list[bytes] = []  # HITs this step, submitted at its end
        self.failed = False  # a load failed: every key is a MISS (the adapter's _failed)
        self.result: int | None = None  # the hit run of the last scan that decided
        self.finished = False


class BridgeMachine(RuleBasedStateMachine):
    """vLLM's scans, the node's thread and a scripted peer, interleaved at random."""

    def __init__(self) -> None:
        super().__init__()
        self.side = self.bridge = self.api = bridge_off_thread()
        self.requests = {kv: Request(kv, peer, list(keys)) for kv, (peer, keys) in REQUESTS.items()}
        self.local: set[bytes] = set()  # this engine's CPU tier
        self.peer_holds: set[bytes] = set(KEYS[:3])
        self.fetches: list[tuple[RequestActor, wire.Fetch]] = []
        self.next_job = 1
        self.jobs: dict[int, Request] = {}

    # --- the engine (vLLM's scheduler and tiering manager) -------------------------

    def scan(self, req: Request) -> int | None:
        """One ``_maximal_prefix_lookup``: the hit run, or None if deferred."""
        hits, deferred, asks = 0, False, []
        for k in req.keys:
            if k in self.local:
                hits += 1
                continue
            if k in req.loading or k in req.promote:
                hits, deferred = hits + 1, True  # HIT_PENDING
                continue
            answer = MISS if req.failed else self.api.lookup_view(req.peer, req.kv).answer(k)
            if answer is RETRY:
                asks.append(k)
                deferred = True
            elif answer is HIT:
                req.promote.append(k)  # the manager starts a promotion: HIT_PENDING
                hits, deferred = hits + 1, True
            else:
                break
        self.api.ask(req.peer, req.kv, asks)
        return None if deferred else hits

    def engine_step_of(self, req: Request) -> None:
        self.collect()
        if not req.finished:
            result = self.scan(req)
            if result is not None:
                req.result = result
        # on_schedule_end: promotions go out as one load per request, then the asks.
        if req.promote:
            job = self.next_job
            self.next_job += 1
            self.jobs[job] = req
            for k in req.promote:
                req.loading[k] = job
            self.api.submit_load(
                req.peer, req.kv, job, req.promote, range(len(req.promote)), wake=False
            )
            req.promote = []
        self.api.flush()

    def collect(self) -> None:
        """``get_finished_jobs``: loaded keys are in the CPU tier now."""
        for result in self.api.finished_jobs():
            req = self.jobs.pop(result.job_id)
            done = [k for k, job in req.loading.items() if job == result.job_id]
            for k in done:
                del req.loading[k]
            if result.success:
                self.local.update(done)
            else:
                req.failed = True

    @rule(kv=st.sampled_from(sorted(REQUESTS)))
    def engine_step(self, kv: str) -> None:
        self.engine_step_of(self.requests[kv])

    @rule(k=st.sampled_from(KEYS))
    def engine_evicts(self, k: bytes) -> None:
        self.local.discard(k)

    @precondition(lambda self: sum(not r.finished for r in self.requests.values()) > 1)
    @rule(kv=st.sampled_from(sorted(REQUESTS)))
    def engine_finishes(self, kv: str) -> None:
        req = self.requests[kv]
        req.finished = True
        self.api.finish(kv, wake=False)

    # --- the node's thread ---------------------------------------------------------

    @rule()
    def node_applies(self) -> None:
        self.bridge._apply()

    @rule(seconds=st.sampled_from([0.001, 1.0, 5.0, 31.0]))
    def time_passes(self, seconds: float) -> None:
        self.side.now += seconds
        for actor in [*self.side.actors.values(), *self.side.retired]:
            if actor.deadline is not None and actor.deadline <= self.side.now:
                self.side.runner.deliver(actor, inp.Tick())

    # --- the peer ------------------------------------------------------------------

    @precondition(lambda self: self.side.to_peer)
    @rule(data=st.data(), stamped=st.booleans())
    def peer_handles_a_message(self, data: st.DataObject, stamped: bool) -> None:
        # Lookups may be answered out of order (a pending key takes longer).
        i = data.draw(st.integers(0, len(self.side.to_peer) - 1))
        actor, msg = self.side.to_peer.pop(i)
        self.peer_handles(actor, msg, stamped=stamped, success=data.draw(st.booleans()))

    def peer_handles(
        self, actor: RequestActor, msg: wire.Message, *, stamped: bool, success: bool
    ) -> None:
        deliver = self.side.runner.deliver
        kv = actor.id.kv_request_id
        if isinstance(msg, wire.Lookup):
            hits = tuple(k in self.peer_holds for k in msg.keys)
            round_seq = msg.round_seq if stamped else wire.UNSET
            deliver(
                actor,
                wire.LookupResp(kv_request_id=kv, keys=msg.keys, hits=hits, round_seq=round_seq),
            )
        elif isinstance(msg, wire.Fetch) and msg.keys:
            ok = success and all(k in self.peer_holds for k in msg.keys)
            deliver(actor, wire.TransferDone(kv_request_id=kv, success=ok, round_seq=msg.round_seq))
        elif isinstance(msg, wire.AbortFetch):
            deliver(actor, wire.AbortAck(kv_request_id=kv, round_seq=msg.round_seq))

    @rule(k=st.sampled_from(KEYS), held=st.booleans())
    def peer_changes(self, k: bytes, held: bool) -> None:
        (self.peer_holds.add if held else self.peer_holds.discard)(k)

    # --- checks --------------------------------------------------------------------

    def settle(self, req: Request, steps: int = 8) -> int:
        """Run engine, node and a responsive peer until the request's scan decides."""
        for _ in range(steps):
            self.engine_step_of(req)
            self.bridge._apply()
            while self.side.to_peer:
                actor, msg = self.side.to_peer.pop(0)
                self.peer_handles(actor, msg, stamped=True, success=True)
            self.collect()
            result = self.scan(req)
            self.api.flush()
            if result is not None and not req.promote:
                return result
            self.bridge._apply()
        answers = [self.api.lookup_view(req.peer, req.kv).answer(k) for k in req.keys]
        raise AssertionError(f"{req.kv} never decided: {answers}")

    def teardown(self) -> None:
        try:
            assert not self.side.failures
            for req in self.requests.values():
                if req.finished:
                    continue
                result = self.settle(req)
                # vLLM scans again once the hit run is loaded: nothing new is asked.
                before = len(self.side.to_peer)
                assert self.scan(req) == result
                self.api.flush()
                self.bridge._apply()
                assert len(self.side.to_peer) == before
                if req.peer == NOWHERE:  # only what the CPU tier holds
                    assert result == next(
                        (i for i, k in enumerate(req.keys) if k not in self.local), len(req.keys)
                    )
            for kv in self.requests:
                self.api.finish(kv)
            self.bridge._apply()
            for _ in range(3):
                while self.side.to_peer:
                    actor, msg = self.side.to_peer.pop(0)
                    self.peer_handles(actor, msg, stamped=True, success=True)
                self.time_passes(31.0)
            assert all(a.done for a in self.side.retired)
            assert not self.side.failures
        finally:
            self.bridge._wakeup.stop()


TestBridgeMachine = BridgeMachine.TestCase
TestBridgeMachine.settings = MACHINE_SETTINGS


def test_a_hit_heard_while_a_fetch_is_handed_over_is_asked_again() -> None:
    """The fetch of a round's first HITs is on its way when the rest are answered.

    vLLM fetched key 0 (answered by a lookup of its own, sent after a local
    eviction) and, before the node's thread took that fetch, the round's other
    lookup answered keys 1 and 2 HIT. The fetch closes the round and their
    pins with it: a HIT now would be fetched in a round no lookup opened, and
    the peer would wait for a store as a disaggregated decode's producer does
    (30 s, then recompute). They are RETRY until the fetch is taken, then
    asked again.
    """
    m = BridgeMachine()
    req = m.requests["r1"]
    m.local = {KEYS[0]}
    m.engine_step_of(req)  # keys 1..3 asked
    m.node_applies()
    m.engine_evicts(KEYS[0])
    m.engine_step_of(req)  # key 0 asked, in a lookup of its own
    m.node_applies()
    assert [type(msg) for _, msg in m.side.to_peer] == [wire.Lookup, wire.Lookup]
    m.peer_handles(*m.side.to_peer.pop(1), stamped=True, success=True)
    m.engine_step_of(req)  # key 0 HIT: its load is handed over
    assert list(req.loading) == [KEYS[0]]
    m.peer_handles(*m.side.to_peer.pop(0), stamped=True, success=True)
    assert m.api.lookup_view(PEER, "r1").answer(KEYS[1]) is RETRY
    m.engine_step_of(req)
    assert list(req.loading) == [KEYS[0]]
    m.node_applies()  # the fetch of key 0 (the offered check in stepped), then the ask
    fetches = [msg for _, msg in m.side.to_peer if isinstance(msg, wire.Fetch)]
    assert [f.keys for f in fetches] == [(KEYS[0],)]
    m.teardown()
