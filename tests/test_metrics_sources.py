"""The source directory in ``/metrics`` and ``/status``: choices, summaries, the index.

Three in-memory nodes on trio's mock clock: b and c tell a what they hold; a
gap forged in b's summary makes a ask it for a snapshot; then a locates
requests that name no source (one chosen, one nobody claims, one not worth a
round trip, one on a false claim forged in b's name). The summary figures must
equal what crossed the network (every frame tapped), the choice figures what a
did, and ``/status``'s ``sources`` must say what ``/metrics`` says.
"""

from __future__ import annotations

import json

import pytest
import trio

from p2pactor.core import protocol as wire
from p2pactor.core.choice import ChoicePolicy
from p2pactor.core.inputs import LookupResult
from p2pactor.core.sources import fingerprint
from p2pactor.runtime.sources import SourceOptions
from p2pactor.surface.status import node_status
from tests.cluster import Cluster, Member, key, open_cluster
from tests.test_directory import linked, tap, until
from tests.test_directory import pull as locate_and_pull
from tests.test_metrics import samples, value

MISS = LookupResult.MISS
# One key's prefill (256 tokens x 50 us = 12.8 ms) is not worth this round trip;
# two keys' (25.6 ms) are.
POLICY = ChoicePolicy(round_trip_s=0.015)


def forge_claims(
    cluster: Cluster, to: Member, sender: Member, keys: list[bytes], *, skip: int = 0
) -> None:
    """Post ``to`` the next delta of ``sender``'s summary (``skip`` past it), claiming ``keys``."""
    position = to.node.directory.index.position(sender.id)
    assert position is not None
    epoch, seq, _ = position
    delta = wire.KvsumDelta(
        epoch=epoch,
        seq=seq + 1 + skip,
        add=wire.packed([fingerprint(k) for k in keys]),
        remove=b"",
    )
    cluster.network.post(sender.id, to.id, wire.encode(delta))


def fingerprint_bytes(msg: wire.Message) -> int:
    """The fingerprint bytes a summary message carries (what the directory counts)."""
    if isinstance(msg, wire.KvsumDelta):
        return len(msg.add) + len(msg.remove)
    if isinstance(msg, wire.KvsumSnapshot):
        return len(msg.fps)
    return 0


async def test_the_directory_counts_equal_what_it_chose_and_what_crossed_the_wire(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b", "c", sources=SourceOptions(choice=POLICY)) as cluster:
        a, b, c = cluster["a"], cluster["b"], cluster["c"]
        seen = tap(cluster)
        b.store(*[key(i) for i in range(5)])
        c.store(key(0), key(1))
        await linked(b, a)
        await linked(c, a)
        index = a.node.directory.index
        await until(lambda: len(index.peer(b.id).claims) == 5 and len(index.peer(c.id).claims) == 2)

        def snapshots_from_b() -> int:
            return sum(
                isinstance(m, wire.KvsumSnapshot) and (src, dst) == (b.id, a.id)
                for _, src, dst, m in seen
            )

        # a gap in b's summary: a asks b for a snapshot, and b sends it
        assert snapshots_from_b() == 1
        before = index.position(b.id)
        assert before is not None
        forge_claims(cluster, a, b, [key(30)], skip=3)
        await until(lambda: snapshots_from_b() == 2)
        assert len(index.peer(b.id).claims) == 5

        # chosen: b claims the longest run (5 of 7 keys), and holds it
        peer, hits = await locate_and_pull(a, "r-chosen", [key(i) for i in range(7)])
        assert (peer, len(hits)) == (b.id, 5)
        # unclaimed: nobody claims the first key
        located = await a.node.locate("r-unclaimed", [key(9), key(0)])
        assert located.peer is None
        assert located.choice.claims == ()
        # not worth it: b and c claim one key each, too little for a round trip
        located = await a.node.locate("r-not-worth", [key(0), key(9)])
        assert located.peer is None
        assert len(located.choice.claims) == 2
        # a false claim: "b" says it holds two keys it never had, and b answers MISS
        forge_claims(cluster, a, b, [key(20), key(21)])
        await until(lambda: len(index.peer(b.id).claims) == 7)
        assert len(index) == 7 + 2  # claims: b's 7 and c's 2, the keys they share twice
        located = await a.node.locate("r-false", [key(20), key(21)])
        assert located.peer == b.id
        assert located.answers == (MISS, MISS)
        a.node.finish("r-false")
        await until(lambda: not a.node.directory.auto and len(index.peer(b.id).claims) == 5)
        # a has told b and c of the 5 blocks it fetched
        await until(lambda: sum(fingerprint_bytes(m) for _, src, _, m in seen if src == a.id) == 80)

        got = samples(a.surface.metrics.exposition())
        status = node_status(a.node, totals=a.surface.metrics.totals())
        precision_b = index.precision(b.id)
        index_bytes = index.nbytes

    assert value(got, "p2pactor_source_choices_total", outcome="chosen") == 2
    assert value(got, "p2pactor_source_choices_total", outcome="unclaimed") == 1
    assert value(got, "p2pactor_source_choices_total", outcome="not_worth") == 1
    assert value(got, "p2pactor_source_probed_keys_total") == 5 + 2
    assert value(got, "p2pactor_source_false_claims_total") == 2
    assert value(got, "p2pactor_source_refused_claims_total") == 0
    assert value(got, "p2pactor_source_undelivered_claims_total") == 0

    # The summary figures are the frames' own.
    summaries = [(src, dst, m) for _, src, dst, m in seen if m.TYPE.startswith("kvsum_")]
    sent = [m for src, _, m in summaries if src == a.id]
    received = [m for _, dst, m in summaries if dst == a.id]
    deltas = sum(isinstance(m, wire.KvsumDelta) for m in sent)
    parts = sum(isinstance(m, wire.KvsumSnapshot) for m in sent)
    resyncs = [m for m in sent if isinstance(m, wire.KvsumResync)]
    assert [m.from_seq for m in resyncs] == [before[1] + 1]  # all after what a had
    assert deltas == 2  # the 5 blocks a fetched, told to b and c at one flush
    assert parts == 2  # a's (empty) summary, one part to each peer
    assert len(resyncs) == 1
    messages = "p2pactor_summary_messages_total"
    assert value(got, messages, kind="delta") == deltas
    assert value(got, messages, kind="snapshot_part") == parts
    assert value(got, "p2pactor_summary_resyncs_total") == 1
    bytes_sent = sum(fingerprint_bytes(m) for m in sent)
    bytes_received = sum(fingerprint_bytes(m) for m in received)
    assert bytes_sent == 8 * 5 * 2  # 5 keys, to 2 peers
    assert value(got, "p2pactor_summary_bytes_total", direction="sent") == bytes_sent
    assert value(got, "p2pactor_summary_bytes_total", direction="received") == bytes_received

    # The index now: b's 5 keys (its false claims dropped), c's 2 within them.
    assert value(got, "p2pactor_source_index_claims") == 5 + 2
    assert value(got, "p2pactor_source_index_bytes") == index_bytes > 0
    assert value(got, "p2pactor_source_summary_floods_total") == 0
    assert value(got, "p2pactor_source_peers", state="synced") == 2
    assert value(got, "p2pactor_source_peers", state="syncing") == 0
    claimed = "p2pactor_source_peer_claimed_keys"
    assert value(got, claimed, peer=b.id) == 5
    assert value(got, claimed, peer=c.id) == 2
    keep = 1.0 - POLICY.precision_weight
    assert precision_b == pytest.approx(keep**2)  # 1.0, then 2 keys missed
    assert value(got, "p2pactor_source_peer_precision", peer=b.id) == precision_b
    assert value(got, "p2pactor_source_peer_precision", peer=c.id) == 1.0  # never probed
    assert value(got, "p2pactor_source_peer_quarantined", peer=b.id) == 0
    assert ("p2pactor_source_peer_quarantined", frozenset({("peer", b.id)})) in got
    assert value(got, "p2pactor_source_advertised_keys") == 5  # what a fetched

    # /status says the same, as JSON.
    sources = json.loads(json.dumps(status["sources"]))
    assert sources == {
        "enabled": True,
        "choices": {"chosen": 2, "unclaimed": 1, "not_worth": 1},
        "probed_keys": 7,
        "false_claims": 2,
        "refused_claims": 0,
        "undelivered_claims": 0,
        "summaries": {
            "deltas_sent": deltas,
            "parts_sent": parts,
            "resyncs_sent": 1,
            "bytes_sent": bytes_sent,
            "bytes_received": bytes_received,
            "floods": 0,
        },
        "advertised_keys": 5,
        "index_claims": 7,
        "index_bytes": index_bytes,
        "index_pending": False,
        "peers": [
            {
                "peer": b.id,
                "synced": True,
                "claimed_keys": 5,
                "precision": round(precision_b, 4),
                "quarantined": False,
            },
            {
                "peer": c.id,
                "synced": True,
                "claimed_keys": 2,
                "precision": 1.0,
                "quarantined": False,
            },
        ],
    }


async def test_a_peer_whose_claims_keep_missing_shows_quarantined(
    autojump_clock: trio.abc.Clock,
) -> None:
    policy = ChoicePolicy(min_probed_keys=2, precision_weight=1.0)
    async with open_cluster("a", "b", sources=SourceOptions(choice=policy)) as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(0))
        await linked(b, a)
        index = a.node.directory.index
        await until(lambda: len(index.peer(b.id).claims) == 1)
        forge_claims(cluster, a, b, [key(20), key(21)])
        await until(lambda: len(index.peer(b.id).claims) == 3)
        located = await a.node.locate("r", [key(20), key(21)])
        assert located.answers == (MISS, MISS)
        a.node.finish("r")
        await until(lambda: index.quarantined(b.id, a.node.now()))
        got = samples(a.surface.metrics.exposition())
        status = node_status(a.node, totals=a.surface.metrics.totals())
        # b stays quarantined for a minute: a request that names no source finds nobody
        later = await a.node.locate("r2", [key(0)])
        assert later.peer is None
        a.node.finish("r2")
    assert value(got, "p2pactor_source_peer_quarantined", peer=b.id) == 1
    assert value(got, "p2pactor_source_peer_precision", peer=b.id) == 1.0  # starts over after
    assert value(got, "p2pactor_source_false_claims_total") == 2
    assert [(p["peer"], p["quarantined"]) for p in status["sources"]["peers"]] == [(b.id, True)]


async def test_a_node_that_shares_no_summary_reports_nothing_claimed_or_advertised(
    autojump_clock: trio.abc.Clock,
) -> None:
    off = SourceOptions(share=False)
    async with open_cluster("a", "b", sources=off) as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(0))
        await linked(b, a)
        a.store(key(1))
        located = await a.node.locate("r", [key(0)])
        assert located.peer is None
        got = samples(a.surface.metrics.exposition())
        status = node_status(a.node, totals=a.surface.metrics.totals())
    assert value(got, "p2pactor_source_advertised_keys") == 0
    assert value(got, "p2pactor_source_index_claims") == 0
    assert value(got, "p2pactor_source_peers", state="synced") == 0
    assert value(got, "p2pactor_summary_bytes_total", direction="received") == 0
    assert ("p2pactor_summary_bytes_total", frozenset({("direction", "sent")})) in got
    assert status["sources"]["enabled"] is False
    assert status["sources"]["peers"] == []
