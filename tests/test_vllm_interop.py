"""vLLM P2P tiers in separate processes exchanging KV blocks over real ZeroMQ and NIXL.

Each side is one ``tests/vllm_tier_host.py`` process hosting a tier exactly as
vLLM 0.33 builds it (a real ``TieringOffloadingSpec``, the factory, a CPU
primary region) and driven like vLLM's scheduler drives it, with vLLM's
tier-poll thread serving peers between steps (``tests/vllm_interop.py``).
Every scenario runs in both directions: ``a`` pulls from ``b`` and ``b`` from ``a``.

The pair of tier classes is a parameter: vLLM's own ``P2PSecondaryTierManager``
against itself, and, where ``p2pactor.adapters.vllm`` imports, ours against
vLLM's in both roles and against itself. A pair whose class cannot be imported
in a host is skipped with the import error.

The module is skipped when vLLM is not installed. It never imports vLLM itself
(an import takes seconds and raises a DeprecationWarning, an error here); the
hosts do.
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from tests.vllm_interop import (
    OURS,
    STOCK,
    HostPool,
    HostSpec,
    TierHost,
    decoder_params,
    expected_digest,
    make_key,
    make_keys,
    open_tier_hosts,
    prefiller_params,
    vllm_p2p_missing,
)

if (_MISSING := vllm_p2p_missing()) is not None:
    pytest.skip(_MISSING, allow_module_level=True)

CHUNK = 64 * 1024
# Chunks per host: a host serves every test of the module that names it (for
# several pairs), and a host's chunks are never evicted.
NUM_CHUNKS = 128
PENDING_TIMEOUT_S = 5.0  # the producer answers a still-pending key MISS after this

_ours_missing = importlib.util.find_spec(OURS.partition(":")[0]) is None
_no_ours = pytest.mark.skipif(_ours_missing, reason=f"{OURS} does not exist yet")
PAIRS = [
    pytest.param((STOCK, STOCK), id="stock-stock"),
    pytest.param((OURS, STOCK), id="ours-stock", marks=_no_ours),
    pytest.param((STOCK, OURS), id="stock-ours", marks=_no_ours),
    pytest.param((OURS, OURS), id="ours-ours", marks=_no_ours),
]
Pair = tuple[TierHost, TierHost]


def short(tier: str) -> str:
    return "ours" if tier == OURS else "stock"


def slots(tiers: tuple[str, str]) -> tuple[str, str]:
    """Pool hosts of a pair: side a is host 1 of its class, side b host 2."""
    return f"{short(tiers[0])}-1", f"{short(tiers[1])}-2"


@pytest.fixture(scope="module")
def pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HostPool]:
    """Every host this module's selected tests need, started together and shared.

    Sharing keeps the module fast (each host imports vLLM for seconds of CPU);
    the parent contract is then checked over each host's whole life.
    """
    wanted: dict[str, str] = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is not request.module:
            continue
        for key in ("pair", "killed_pair"):
            if key in params:
                wanted.update(zip(slots(params[key]), params[key], strict=True))
    hosts = HostPool(tmp_path_factory.mktemp("vllm-interop"))
    hosts.start(
        HostSpec(tier, name=name, chunk_bytes=CHUNK, num_chunks=NUM_CHUNKS)
        for name, tier in wanted.items()
    )
    try:
        yield hosts
    finally:
        hosts.close()


def hosts_of(pool: HostPool, names: Iterable[str], tiers: Iterable[str]) -> list[TierHost]:
    for tier in tiers:
        if tier in pool.unimportable:
            pytest.skip(f"{tier} does not import: {pool.unimportable[tier]}")
    return [pool[name] for name in names]


@pytest.fixture(params=PAIRS)
def pair(request: pytest.FixtureRequest, pool: HostPool) -> Pair:
    tiers: tuple[str, str] = request.param
    a, b = hosts_of(pool, slots(tiers), tiers)
    return a, b


def both_ways(pair: Pair) -> list[Pair]:
    """(consumer, producer) in each direction."""
    a, b = pair
    return [(a, b), (b, a)]


def pull(consumer: TierHost, producer: TierHost, req: str) -> None:
    """A symmetric-P2P request on ``consumer`` that pulls from ``producer``."""
    consumer.new_request(req, consumer.source_params(producer, f"kv-{req}"))


def calls_of(host: TierHost, since: int, method: str) -> list[dict[str, Any]]:
    return [c for c in host.calls(since) if c["method"] == method]


def pinned_keys(host: TierHost, since: int) -> set[str]:
    return {k for c in calls_of(host, since, "create_store_job") for k in c["keys"]}


def fetch(consumer: TierHost, req: str, keys: list[bytes]) -> None:
    """Load ``keys`` and check every byte."""
    job = consumer.submit_load(req, keys)
    result = consumer.wait_job(job, timeout=10)
    assert result["success"], result
    assert consumer.verify(keys) == [True] * len(keys)
    assert consumer.read(keys) == [expected_digest(k, CHUNK) for k in keys]


def assert_clean(*hosts: TierHost, timeout: float = 5.0) -> None:
    """vLLM's parent contract held: every context finished once, every pin released once."""
    for host in hosts:
        report = host.wait_quiet(timeout)
        assert report["violations"] == [], (host.name, report["violations"])
        assert report["errors"] == [], (host.name, report["errors"])
        assert report["quiet"], (host.name, report)
        assert report["ctxs_opened"] == report["ctxs_finished"], (host.name, report)
        assert report["pins"] == 0, (host.name, report)


def test_hosts_agree_on_seed_and_fingerprint(pair: Pair) -> None:
    a, b = pair
    for host in pair:
        assert host.info["hash_seed"] == "0"
        assert host.info["local_id"] == f"127.0.0.1:{host.port}"
        assert host.info["chunk_bytes"] == CHUNK
        if host.info["nixl_agent"] is not None:  # vLLM's tier tells
            assert host.info["nixl_agent"], f"{host.name} built no NIXL agent"
    assert len(a.info["fingerprint"]) == 16
    assert a.info["fingerprint"] == b.info["fingerprint"]
    assert a.info["config_fields"]["model_name"] == "Qwen/Qwen3-0.6B"


def test_harness_flags_contract_breaches(pair: Pair) -> None:
    report = pair[0].selftest()
    assert report["violations"] == [
        "lookup(a) called outside serve_external_requests",
        "lookup on unopened context a",
        "on_new_request twice for open context a",
        "create_store_job(a) for keys that are no HIT: [" + repr((b"o" * 36).hex()) + "]",
        "on_request_finished twice for a",
        "on_request_finished for unopened b",
        "lookup on after on_request_finished context a",
        "job 1000 reported finished twice",
        "tier reported unknown job 99",
    ]
    assert report["open_ctxs"] == ["b"]


def test_hits_misses_and_byte_exact_fetch(pair: Pair) -> None:
    for consumer, producer in both_ways(pair):
        tag = f"hm-{consumer.name}-{producer.name}"
        hits, misses = make_keys(f"{tag}-hit", 4), make_keys(f"{tag}-miss", 3)
        producer.store(hits)
        mark = len(producer.calls())
        pull(consumer, producer, tag)

        assert consumer.lookup(tag, hits + misses) == ["RETRY"] * 7  # nothing asked yet
        answer = consumer.lookup_until(tag, hits + misses, timeout=10)
        assert answer["results"] == ["HIT"] * 4 + ["MISS"] * 3
        assert pinned_keys(producer, mark) == {k.hex() for k in hits}  # pinned at lookup

        assert consumer.read(hits) == [None] * 4
        fetch(consumer, tag, hits)
        consumer.finish(tag)
    assert_clean(*pair)


def test_pending_keys_resolve_or_expire(pair: Pair) -> None:
    """HIT_PENDING on the producer: resolves to HIT when written, MISS at its deadline if never.

    The MISS is the producer's own: its parent only ever answered HIT_PENDING,
    and it closed the lookup's context itself, before the consumer finished.
    Not before its deadline: the lookup reached it after ``started`` (the
    consumer's clock before the lookup went out) and the producer's record of
    the close is ``PENDING_TIMEOUT_S`` past that at least (the hosts share the
    machine's monotonic clock). A p2pactor producer also records its
    deadline, ``PENDING_TIMEOUT_S`` after the lookup, and expires the key
    only once it passed. The wait for the answer is bounded well inside the
    consumer's own 30 s lookup timeout, whose MISS it must not be.
    """
    cases = []
    for consumer, producer in both_ways(pair):
        tag = f"pend-{consumer.name}-{producer.name}"
        stored, soon, never = (
            make_keys(f"{tag}-stored", 2),
            make_key(f"{tag}-soon"),
            make_key(f"{tag}-never"),
        )
        producer.store(stored)
        producer.mark_pending([soon, never])
        mark = len(producer.calls())
        pull(consumer, producer, f"{tag}-soon")
        pull(consumer, producer, f"{tag}-never")
        started = consumer.on_one_clock(consumer.clock())
        assert consumer.lookup(f"{tag}-soon", [*stored, soon]) == ["RETRY"] * 3
        assert consumer.lookup(f"{tag}-never", [never]) == ["RETRY"]
        cases.append((consumer, producer, tag, stored, soon, never, mark, started))

    for consumer, producer, tag, stored, soon, never, mark, _ in cases:
        # The producer saw both keys pending and parked the lookups.
        def parked(
            producer: TierHost = producer, mark: int = mark, keys: Any = (soon, never)
        ) -> bool:
            seen = {
                k
                for c in calls_of(producer, mark, "lookup")
                if c["result"] == "HIT_PENDING"
                for k in c["keys"]
            }
            return seen >= {k.hex() for k in keys}

        consumer.until(parked, timeout=10)
        # One answer per lookup: the stored keys wait with the pending one.
        assert consumer.lookup(f"{tag}-soon", [*stored, soon]) == ["RETRY"] * 3
        producer.store([soon])
        answer = consumer.lookup_until(f"{tag}-soon", [*stored, soon], timeout=10)
        assert answer["results"] == ["HIT"] * 3  # the expiry would have made it a MISS
        fetch(consumer, f"{tag}-soon", [*stored, soon])
        consumer.finish(f"{tag}-soon")

    for consumer, producer, tag, _, _, never, mark, started in cases:
        answer = consumer.lookup_until(f"{tag}-never", [never], timeout=PENDING_TIMEOUT_S + 10)
        assert answer["results"] == ["MISS"]
        calls = producer.calls(mark)
        asked = [c for c in calls if c["method"] == "lookup" and c["keys"] == [never.hex()]]
        assert asked, calls
        assert {c["result"] for c in asked} == {"HIT_PENDING"}, asked  # never a parent MISS
        (ctx,) = {c["req"] for c in asked}

        def closing(producer: TierHost = producer, mark: int = mark, ctx: str = ctx) -> list[Any]:
            return [c for c in calls_of(producer, mark, "on_request_finished") if c["req"] == ctx]

        # Closed by the producer: the consumer has not finished.
        closed = producer.until(closing, timeout=10)
        assert len(closed) == 1, closed
        waited = producer.on_one_clock(closed[0]["t"]) - started
        assert waited >= PENDING_TIMEOUT_S, f"{producer.name} expired the key after {waited} s"
        events = producer.producer_events(f"kv-{tag}-never")
        if events is not None:  # a p2pactor producer: its deadline, and the expiry past it
            (received,) = [e for e in events if e["kind"] == "LookupReceived"]
            assert received["deadline"] - received["at"] == pytest.approx(PENDING_TIMEOUT_S)
            (expired,) = [e for e in events if e["kind"] == "PendingExpired"]
            assert expired["keys"] == [never.hex()]
            assert expired["at"] >= received["deadline"]
        assert never.hex() not in pinned_keys(producer, mark)  # a timed-out key is never pinned
        consumer.finish(f"{tag}-never")
    assert_clean(*pair)


def test_finish_with_open_lookup_closes_it_on_the_producer(pair: Pair) -> None:
    """Finishing while a lookup is open sends the terminal empty fetch.

    The producer has pinned the stored keys and parked the lookup on a pending
    key; the empty fetch must release the pins and finish the synthetic
    context, not its expiry. The producer's record of the last close comes
    before the expiry could: the lookup reached it after ``started`` (the
    consumer's clock before the lookup went out), so its deadline is
    ``PENDING_TIMEOUT_S`` past that at least. A p2pactor producer also
    records why: the lookup dropped (on the close) before its recorded
    deadline, and no expiry.
    """
    for consumer, producer in both_ways(pair):
        tag = f"open-{consumer.name}-{producer.name}"
        stored, parked_key = make_keys(f"{tag}-stored", 2), make_key(f"{tag}-parked")
        producer.store(stored)
        producer.mark_pending([parked_key])
        mark = len(producer.calls())
        pull(consumer, producer, tag)
        started = consumer.on_one_clock(consumer.clock())
        assert consumer.lookup(tag, [*stored, parked_key]) == ["RETRY"] * 3

        def parked(
            producer: TierHost = producer, mark: int = mark, key: bytes = parked_key
        ) -> bool:
            # Pinned the stored keys, and asked again for the pending one a few
            # times: the lookup is parked for good, not just arriving.
            polls = sum(
                c["result"] == "HIT_PENDING" and c["keys"] == [key.hex()]
                for c in calls_of(producer, mark, "lookup")
            )
            return polls >= 5 and bool(calls_of(producer, mark, "create_store_job"))

        consumer.until(parked, timeout=10)
        report = producer.parent_report()
        assert report["open_ctxs"], report
        assert {k for j in report["unreleased_jobs"] for k in j["keys"]} >= {
            k.hex() for k in stored
        }

        consumer.finish(tag)
        consumer.step(2)
        report = producer.wait_quiet(timeout=10)
        assert report["quiet"], report
        calls = producer.calls(mark)
        opened = [c for c in calls if c["method"] == "on_new_request"]
        closed = [c for c in calls if c["method"] == "on_request_finished"]
        assert opened, calls
        assert sorted(c["req"] for c in closed) == sorted(c["req"] for c in opened)
        last = producer.on_one_clock(max(c["t"] for c in closed))
        assert last < started + PENDING_TIMEOUT_S, (
            f"{producer.name} kept the parked lookup until its expiry instead of closing "
            f"it on {consumer.name}'s terminal empty fetch"
        )
        events = producer.producer_events(f"kv-{tag}")
        if events is not None:  # a p2pactor producer: dropped, not expired, before its deadline
            kinds = [e["kind"] for e in events]
            assert "PendingExpired" not in kinds, events
            (received,) = [e for e in events if e["kind"] == "LookupReceived"]
            (dropped,) = [e for e in events if e["kind"] == "LookupDropped"]
            assert dropped["at"] < received["deadline"], events
        producer.store([parked_key])  # leave nothing pending behind
    assert_clean(*pair)


def test_prefill_decode_store_then_fetch(pair: Pair) -> None:
    """PD mode: the prefiller's ``submit_store`` (pinned) waits for the decoder's fetch."""
    for consumer, producer in both_ways(pair):
        tag = f"pd-{consumer.name}-{producer.name}"
        keys = make_keys(tag, 3)
        producer.new_request(tag, decoder_params(f"kv-{tag}"))
        producer.store(keys)
        store_job = producer.submit_store(tag, keys)
        assert producer.parent_report()["pins"] >= 3  # held for the decoder

        consumer.new_request(tag, prefiller_params(producer, f"kv-{tag}"))
        assert consumer.lookup(tag, keys) == ["HIT"] * 3  # no probing in PD mode
        consumer.step()
        fetch(consumer, tag, keys)
        assert producer.wait_job(store_job, timeout=10)["success"]
        consumer.finish(tag)
        producer.finish(tag)
    assert_clean(*pair)


def computed(host: TierHost, tag: str, keys: list[bytes]) -> None:
    """``host``'s engine computed ``keys``: its CPU tier holds them, and vLLM cascades
    the store to its tiers (for a request with no P2P role)."""
    host.new_request(tag, None)
    host.store(keys)
    assert host.wait_job(host.submit_store(tag, keys), timeout=10)["success"]
    host.finish(tag)


def found_by_itself(consumer: TierHost, tag: str, keys: list[bytes], timeout: float) -> str:
    """Open requests naming no source until one finds every key (the summary came): its id."""
    deadline = time.monotonic() + timeout
    for attempt in itertools.count():
        req = f"{tag}-{attempt}"
        consumer.new_request(req, None)
        if consumer.lookup_until(req, keys, timeout=10)["results"] == ["HIT"] * len(keys):
            return req
        consumer.finish(req)
        assert time.monotonic() < deadline, f"{consumer.name} never found {tag}'s keys"
        consumer.step(10, sleep_s=0.01)
    raise AssertionError("unreachable")


def test_a_request_naming_no_source_finds_it_and_a_stock_peer_never_hears_of_summaries(
    pair: Pair,
) -> None:
    """Automatic choice between p2pactor tiers; none with or for a stock vLLM tier.

    Both p2pactor: the consumer's request names no source, and its keys are
    found on the producer that computed them and fetched byte for byte. Any
    stock side: the request is a MISS (a stock tier reads no summary, and sends
    none), and the stock tier never logs an unknown message type: no summary
    message reached it, though the p2pactor side held keys to tell of.
    """
    for consumer, producer in both_ways(pair):
        tag = f"auto-{consumer.name}-{producer.name}"
        # A run worth its round trip: a key is one 16-token chunk of the
        # host's spec, 0.8 ms of prefill at the policy's 50 us a token, and a
        # lookup is taken to cost 3 ms (ChoicePolicy): 3 keys would not be.
        keys = make_keys(tag, 8)
        computed(producer, f"{tag}-computed", keys)
        computed(consumer, f"{tag}-own", make_keys(f"{tag}-own", 2))  # a summary to tell
        named = f"{tag}-named"  # a session between the two (auto choice uses any)
        pull(consumer, producer, named)
        assert consumer.lookup_until(named, keys[:1], timeout=10)["results"] == ["HIT"]
        consumer.finish(named)
        if consumer.spec.tier == OURS and producer.spec.tier == OURS:
            req = found_by_itself(consumer, tag, keys, timeout=10)
            fetch(consumer, req, keys)
        else:
            req = f"{tag}-none"
            consumer.new_request(req, None)
            consumer.step(20, sleep_s=0.01)  # time for any summary to arrive
            assert consumer.lookup_until(req, keys, timeout=10)["results"] == ["MISS"] * len(keys)
        consumer.finish(req)
    assert_clean(*pair)
    for host in pair:
        if host.spec.tier == STOCK:
            assert "unknown message type" not in host.log_text(), host.name


def test_parent_contract_clean_on_both_sides(pair: Pair) -> None:
    assert_clean(*pair)
    for host in pair:
        report = host.parent_report()
        assert report["ctxs_opened"] > 0 or report["jobs"] > 0, f"{host.name} did nothing"


@pytest.mark.parametrize(
    "killed_pair",
    [
        pytest.param((STOCK, STOCK), id="stock-stock"),
        pytest.param((OURS, OURS), id="ours-ours", marks=_no_ours),
    ],
)
def test_killed_producer_turns_lookups_into_misses(
    pool: HostPool, killed_pair: tuple[str, str]
) -> None:
    """SIGKILL of a producer: its consumer falls back to MISS, it does not hang.

    Kills side b of the pair (the pool restarts it if a later test needs it).
    """
    consumer, producer = hosts_of(pool, slots(killed_pair), killed_pair)
    tag = f"killed-{consumer.name}-{producer.name}"
    keys = make_keys(tag, 2)
    producer.store(keys)
    pull(consumer, producer, tag)
    answer = consumer.lookup_until(tag, keys, timeout=10)
    assert answer["results"] == ["HIT"] * 2  # the session works
    consumer.finish(tag)

    pull(consumer, producer, f"{tag}-2")
    assert consumer.lookup(f"{tag}-2", keys) == ["RETRY"] * 2
    producer.kill()
    answer = consumer.lookup_until(f"{tag}-2", keys, timeout=15)
    assert answer["results"] == ["MISS"] * 2
    consumer.finish(f"{tag}-2")
    assert_clean(consumer)


def test_a_stock_consumers_slow_trickle_keeps_its_pins_on_our_producer(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """vLLM #56836 at a tenth of its scale: pins of 1 s, 8 keys trickled over 4 s, one fetch.

    A stock consumer sends one lookup per step with the keys new in it, all of one
    kv_request_id; each renews the pins our producer holds for the request, so
    the fetch of all 8 finds every one (with leases off, the first pins would be
    3 s gone). Real time: ``pin_timeout_s`` is scaled down instead of waiting 40 s.
    """
    if _ours_missing:
        pytest.skip(f"{OURS} does not exist yet")
    specs = (
        HostSpec(STOCK, name="trickle-stock", chunk_bytes=CHUNK, num_chunks=32),
        HostSpec(
            OURS,
            name="trickle-ours",
            chunk_bytes=CHUNK,
            num_chunks=32,
            kwargs={"pin_timeout_s": 1.0, "pin_lease_cap_s": 60.0},
        ),
    )
    with open_tier_hosts(*specs, log_dir=tmp_path_factory.mktemp("trickle")) as hosts:
        consumer, producer = hosts
        keys = make_keys("trickle", 8)
        producer.store(keys)
        pull(consumer, producer, "trickle")
        started = time.monotonic()
        for i in range(len(keys)):
            answer = consumer.lookup_until("trickle", keys[: i + 1], timeout=5)
            assert answer["results"] == ["HIT"] * (i + 1)
            time.sleep(0.5)
        assert time.monotonic() - started >= 4.0
        fetch(consumer, "trickle", keys)
        consumer.finish("trickle")
        events = producer.producer_events("kv-trickle")
        assert events is not None
        lookups = [e for e in events if e["kind"] == "LookupReceived"]
        assert len(lookups) == len(keys), "one lookup a step, of the keys new in it"
        assert len([e for e in events if e["kind"] == "PinsRenewed"]) == len(keys) - 1
        assert_clean(consumer, producer)
