"""vLLM P2P tiers across hosts: ours and vLLM 0.33's own, each on its own namespaced host.

Like ``tests/test_vllm_interop.py``, each tier runs in a
``tests/vllm_tier_host.py`` process driven like vLLM's scheduler drives it, but
every process here runs on a host of :mod:`p2pactor.programs.hosts` (its own
network namespace, hostname and ``/dev/shm``; UCX limited to ``tcp,self`` on
its ``eth0``). Consumers run on ``h1`` and producers on ``h2``, so the ZeroMQ
control messages and the NIXL writes cross the kernel's TCP stack between two
addresses that exist only inside namespaces the module made (and removes).

The producer writes the blocks into the consumer's memory (NIXL WRITE), so each
tier host runs with ``UCX_PROTO_INFO=y`` and the tests read the producer's
``ucp_put`` tables to prove the writes went over ``tcp/eth0``. UCX logs to
stderr (``UCX_LOG_FILE=stderr``), which goes unbuffered into the tier host's
log: a file of UCX's own is block-buffered, and the hosts leave by ``os._exit``.

Skipped without vLLM 0.33's P2P tier or without namespaced hosts (root,
``ip``, ``unshare``). The module never imports vLLM itself; the hosts do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from p2pactor.programs.hosts import Host, hosts_unavailable, open_hosts
from tests.vllm_interop import (
    OURS,
    STOCK,
    HostPool,
    HostSpec,
    TierHost,
    expected_digest,
    make_keys,
    vllm_p2p_missing,
)

if (_MISSING := vllm_p2p_missing()) is not None:
    pytest.skip(_MISSING, allow_module_level=True)
REASON = hosts_unavailable()
if REASON is not None:
    pytest.skip(f"no namespaced hosts: {REASON}", allow_module_level=True)

# Imported only now: it loads p2pactor's test helpers (trio, the driven node).
from tests.test_hosts import SHARED_MEMORY, put_transports  # noqa: E402

CHUNK = 64 * 1024
PORT = 5710  # every host is a fresh namespace: the same port on each

PAIRS = [
    pytest.param((OURS, STOCK), id="ours-pulls-from-stock"),
    pytest.param((STOCK, OURS), id="stock-pulls-from-ours"),
    pytest.param((OURS, OURS), id="ours-pulls-from-ours"),
    pytest.param((STOCK, STOCK), id="stock-pulls-from-stock"),
]


def short(tier: str) -> str:
    return "ours" if tier == OURS else "stock"


def consumer_name(tier: str) -> str:
    return f"{short(tier)}-h1"


def producer_name(tier: str) -> str:
    return f"{short(tier)}-h2"


def spec(tier: str, name: str, on: Host, port: int) -> HostSpec:
    env = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": "stderr"}
    return HostSpec(tier, name=name, on=on, port=port, chunk_bytes=CHUNK, env=env)


@pytest.fixture(scope="module")
def pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HostPool]:
    """Two hosts, and on them the tier hosts the selected tests need, started together.

    Consumers on ``h1``, producers on ``h2``, one port per tier class on each.
    """
    wanted: dict[str, tuple[str, int]] = {}  # name -> (tier, host index)
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        pair = getattr(getattr(item, "callspec", None), "params", {}).get("pair")
        if pair is not None:
            wanted[consumer_name(pair[0])] = (pair[0], 0)
            wanted[producer_name(pair[1])] = (pair[1], 1)
    with open_hosts(2) as hosts:
        tiers = HostPool(tmp_path_factory.mktemp("vllm-hosts"))
        try:
            tiers.start(
                spec(tier, name, hosts[at], PORT + (tier == OURS))
                for name, (tier, at) in sorted(wanted.items())
            )
            yield tiers
        finally:
            tiers.close()


def pair_of(pool: HostPool, tiers: tuple[str, str]) -> tuple[TierHost, TierHost]:
    for tier in tiers:
        if tier in pool.unimportable:
            pytest.skip(f"{tier} does not import: {pool.unimportable[tier]}")
    return pool[consumer_name(tiers[0])], pool[producer_name(tiers[1])]


def assert_clean(*hosts: TierHost, timeout: float = 5.0) -> None:
    """vLLM's parent contract held: every context finished once, every pin released once."""
    for host in hosts:
        report = host.wait_quiet(timeout)
        assert report["violations"] == [], (host.name, report["violations"])
        assert report["errors"] == [], (host.name, report["errors"])
        assert report["quiet"], (host.name, report)
        assert report["ctxs_opened"] == report["ctxs_finished"], (host.name, report)
        assert report["pins"] == 0, (host.name, report)


def ucx_lines(host: TierHost) -> str:
    """What UCX logged in ``host`` (its lines name the hostname: ``[h2:<pid>:<thread>]``)."""
    assert host.spec.on is not None
    mark = f"] [{host.spec.on.name}:"
    return "\n".join(line for line in host.log_text().splitlines() if mark in line)


def wait_for_remote_puts(host: TierHost, timeout: float = 10.0) -> set[tuple[str, str]]:
    """``host``'s ``ucp_put`` protocols, once one toward another host (inter-node) is logged."""
    deadline = time.monotonic() + timeout
    while True:
        puts = put_transports(ucx_lines(host))
        if any(kind == "inter-node" for kind, _ in puts) or time.monotonic() > deadline:
            return puts
        time.sleep(0.05)


@pytest.mark.parametrize("pair", PAIRS)
def test_lookup_and_byte_exact_fetch_across_hosts(pool: HostPool, pair: tuple[str, str]) -> None:
    consumer, producer = pair_of(pool, pair)
    h1, h2 = consumer.spec.on, producer.spec.on
    assert h1 is not None
    assert h2 is not None
    assert h1.address != h2.address
    assert consumer.info["local_id"] == f"{h1.address}:{consumer.port}"
    assert producer.info["local_id"] == f"{h2.address}:{producer.port}"
    assert consumer.info["fingerprint"] == producer.info["fingerprint"]

    tag = f"x-{consumer.name}-{producer.name}"
    hits, misses = make_keys(f"{tag}-hit", 6), make_keys(f"{tag}-miss", 2)
    producer.store(hits)
    params = consumer.source_params(producer, f"kv-{tag}")
    assert params["remote_kv_source"]["remote_host"] == h2.address
    consumer.new_request(tag, params)

    answer = consumer.lookup_until(tag, hits + misses, timeout=20)
    assert answer["results"] == ["HIT"] * len(hits) + ["MISS"] * len(misses)
    assert consumer.read(hits) == [None] * len(hits)
    job = consumer.submit_load(tag, hits)
    result = consumer.wait_job(job, timeout=20)
    assert result["success"], result
    assert consumer.verify(hits) == [True] * len(hits)
    assert consumer.read(hits) == [expected_digest(k, CHUNK) for k in hits]
    consumer.finish(tag)
    assert_clean(consumer, producer)

    # The producer's NIXL writes went over TCP on its eth0, never shared memory.
    puts = wait_for_remote_puts(producer)
    assert ("inter-node", "tcp/eth0") in puts, (puts, producer.log_path)
    assert {transport for kind, transport in puts if kind != "self"} == {"tcp/eth0"}, puts
    ucx = ucx_lines(producer)
    assert not any(shm in ucx for shm in SHARED_MEMORY), "a shared-memory transport was set up"
