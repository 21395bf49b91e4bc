"""The vLLM tier finds a source by itself, for a request whose parameters name none.

Real tiers in this process (each with its node thread, real ZeroMQ on
127.0.0.1, real NIXL between CPU tensors), stepped the way vLLM's scheduler
steps them (``tests/test_vllm_tier.py``'s harness, whose parent evicts when
a test says so). Each test builds its own engines: what a tier holds is now
told to its peers, and the module-wide pair of that file must not hear of it.
The same flows on vLLM's own stack (its LRU evicting, its cascades, its
promotions) are in ``tests/test_vllm_stack.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.kv_offload.base import ReqContext

from tests.test_vllm_tier import (
    HIT,
    MISS,
    RETRY,
    Engine,
    Harness,
    assert_bytes_moved,
    new_keys,
)


@pytest.fixture
def trio_of_engines() -> Iterator[tuple[Harness, Engine, Engine, Engine]]:
    """``c`` knows ``d`` and ``e`` from its seed list; each test's engines are its own."""
    d, e = Engine("d"), Engine("e")
    c = Engine("c", seed_peers=[d.peer_id, e.peer_id])
    h = Harness(c, d, e)
    try:
        yield h, c, d, e
    finally:
        for engine in (c, d, e):
            engine.shutdown()


def hold(h: Harness, engine: Engine, keys: list[bytes]) -> list[int]:
    """``engine`` computed ``keys``: its CPU tier holds them, and vLLM cascades the store."""
    chunks = engine.put(keys)
    ctx, _ = h.open(engine, None)
    job = h.store(engine, ctx, keys)
    assert h.result(engine, job).success
    h.finish(engine, ctx)
    return chunks


def prefix_lookup(h: Harness, engine: Engine, ctx: ReqContext, keys: list[bytes]) -> list[Any]:
    """Look keys up as vLLM's scheduler does: in order, past a RETRY, up to the first MISS.

    Every step until no answer is RETRY (``_maximal_prefix_lookup``).
    """
    answers: list[Any] = []

    def answered() -> bool:
        answers.clear()
        for k in keys:
            answers.append(engine.tier.lookup(k, ctx))
            if answers[-1] is MISS:
                break
        return RETRY not in answers

    h.steps_until(answered, f"lookups of {ctx.req_id} answered")
    return answers


def claims(engine: Engine, peer: Engine) -> int:
    return len(engine.tier.node.directory.index.peer(peer.peer_id).claims)


def test_a_request_naming_no_source_loads_its_prefix_from_the_peer_that_holds_it(
    trio_of_engines: tuple[Harness, Engine, Engine, Engine],
) -> None:
    h, c, d, e = trio_of_engines
    keys, misses = new_keys(4), new_keys(3)
    src = hold(h, d, keys)
    hold(h, e, keys[:1])  # e holds a shorter run of the same prefix
    h.steps_until(lambda: claims(c, d) == 4 and claims(c, e) == 1, "c has both summaries")

    ctx, _ = h.open(c, None)
    first = [c.tier.lookup(k, ctx) for k in [*keys, *misses]]
    # Claimed keys wait for the choice; past the run, tail_keys (2) more, then a MISS.
    assert first == [RETRY] * 4 + [RETRY, RETRY, MISS]
    assert prefix_lookup(h, c, ctx, [*keys, *misses]) == [HIT] * 4 + [MISS]
    dst = c.chunks(4)
    job = h.load(c, ctx, keys, dst)
    assert h.result(c, job).success
    assert_bytes_moved(d, src, c, dst)
    h.finish(c, ctx)
    h.check()

    probed = [ev for ev in c.tier.node.event_log.recent() if ev.KIND == "Probed"]
    assert len(probed) == 1, [
        ([[*keys, *misses].index(k) for k in p.keys], p.source is not None) for p in probed
    ]
    assert probed[0].actor.peer == d.peer_id
    assert probed[0].source.chosen == d.peer_id
    assert [(cl.peer, cl.run) for cl in probed[0].source.claims] == [
        (d.peer_id, 4),
        (e.peer_id, 1),
    ]
    # What c loaded is c's to claim now: d hears of it. The chunks the load
    # took while in flight are back in c's room.
    h.steps_until(lambda: claims(d, c) == 4, "d sees c's loaded keys")
    held = c.tier.node.directory.holdings
    assert held.room == held.capacity
    assert all(k in held for k in keys)


def test_a_key_nobody_claims_is_a_miss_in_the_same_step(
    trio_of_engines: tuple[Harness, Engine, Engine, Engine],
) -> None:
    h, c, d, _ = trio_of_engines
    held = new_keys(2)
    hold(h, d, held)
    h.steps_until(lambda: claims(c, d) == 2, "c has d's summary")
    ctx, _ = h.open(c, None)
    unknown = new_keys(2)
    assert [c.tier.lookup(k, ctx) for k in [*unknown, *held]] == [MISS] * 4
    for _ in range(5):
        h.step()
        time.sleep(0.001)
    assert [c.tier.lookup(k, ctx) for k in unknown] == [MISS] * 2
    h.finish(c, ctx)
    h.check()
    assert not [ev for ev in c.tier.node.event_log.recent() if ev.KIND == "Probed"]
    assert c.tier._auto.unclaimed == 1


def test_a_key_the_check_finds_evicted_leaves_the_peers_claims(
    trio_of_engines: tuple[Harness, Engine, Engine, Engine],
) -> None:
    h, c, d, _ = trio_of_engines
    keys = new_keys(3)
    hold(h, d, keys)
    h.steps_until(lambda: claims(c, d) == 3, "c has d's summary")
    del d.parent.stored[keys[1]]  # vLLM evicted it: no tier is told
    h.steps_until(lambda: claims(c, d) == 2, "d's check found it gone, and c heard")
    index = c.tier.node.directory.index
    from p2pactor.core.sources import fingerprint  # noqa: PLC0415 -- one use

    assert index.claimed_by(fingerprint(keys[1])) == frozenset()
    h.check()


def test_a_drain_tells_the_peers_to_forget_everything(
    trio_of_engines: tuple[Harness, Engine, Engine, Engine],
) -> None:
    h, c, d, _ = trio_of_engines
    hold(h, d, new_keys(3))
    h.steps_until(lambda: claims(c, d) == 3, "c has d's summary")
    d.tier.drain_jobs()
    h.steps_until(lambda: claims(c, d) == 0, "c heard of d's new epoch")
    h.check()


def test_without_summaries_a_request_naming_no_source_is_a_miss() -> None:
    d = Engine("d")
    c = Engine("c", seed_peers=[d.peer_id], summaries=False)
    h = Harness(c, d)
    try:
        keys = new_keys(2)
        hold(h, d, keys)
        h.steps_until(lambda: c.peer_id in d.sessions(), "c's seed session is up")
        for _ in range(20):
            h.step()
            time.sleep(0.001)
        assert claims(c, d) == 0
        assert claims(d, c) == 0
        ctx, _ = h.open(c, None)
        assert [c.tier.lookup(k, ctx) for k in keys] == [MISS] * 2
        h.finish(c, ctx)
        h.check()
    finally:
        c.shutdown()
        d.shutdown()


def test_a_key_is_worth_the_tokens_of_one_chunk_of_the_spec() -> None:
    from p2pactor.adapters._vllm_api import source_options  # noqa: PLC0415
    from p2pactor.runtime.sources import SourceOptions  # noqa: PLC0415
    from tests.test_vllm_tier import offloading_spec  # noqa: PLC0415

    spec = offloading_spec()
    spec.blocks_per_chunk = 4
    options = source_options(SourceOptions(), spec, None)
    assert options.choice.tokens_per_key == 16 * 4
    assert options.share
    assert not source_options(SourceOptions(), spec, False).share
    # A spec that says nothing of its chunks keeps the policy's default.
    assert source_options(SourceOptions(), object(), None) == SourceOptions()
