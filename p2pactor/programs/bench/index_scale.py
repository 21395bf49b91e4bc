"""Index scale: what the source index costs a node as the fleet grows (16, 64, 128 peers).

In-process: one :class:`~p2pactor.core.sources.SourceIndex` fed as a node's directory feeds
it, each peer's snapshot in parts, then deltas of 1,000 changes (``KEYS`` keys a peer, a
fifth shared): bytes per claim (``tracemalloc``), time per changed fingerprint and per
choice over 128 keys, the longest single call (the garbage collector included).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc

from p2pactor.core.protocol_summaries import packed
from p2pactor.core.sources import SourceIndex
from p2pactor.programs.bench.cli import BenchOptions, Cell, SectionResult, Stat

TITLE = "the source index at 16, 64 and 128 peers: memory per claim, time per change and choice"
"""One line saying what is measured."""

FLEETS = (16, 64, 128)
KEYS, QUICK_KEYS = 50_000, 2_000
SHARED = 0.2
PART = 8_192
DELTA = 1_000
DELTAS_PER_PEER, QUICK_DELTAS = 20, 4
CHOICES = 1_000
TARGET_BYTES, TARGET_CHANGE_US, TARGET_CHOICE_US = 24, 0.3, 100.0
EPOCH = b"index-scale-ep16"


def _fleet(peers: int, keys: int, rng: random.Random) -> list[list[int]]:
    """Each peer's held fingerprints: a fifth from a shared pool, the rest its own."""
    pool = [rng.getrandbits(64) for _ in range(keys)]
    shared = int(keys * SHARED)
    return [
        rng.sample(pool, shared) + [rng.getrandbits(64) for _ in range(keys - shared)]
        for _ in range(peers)
    ]


def _feed(index: SourceIndex, held: list[list[int]], keys: int) -> float:
    """Every peer's snapshot into ``index``; the longest single call (seconds)."""
    longest = 0.0
    for p, fps in enumerate(held):
        peer = f"peer-{p}"
        index.add_peer(peer, capacity=2 * keys)
        parts = -(-len(fps) // PART)
        for part in range(parts):
            fields = packed(fps[part::parts])  # as the wire carries it: the sender's work
            t0 = time.perf_counter()
            index.snapshot(peer, EPOCH, 0, part=part, parts=parts, fps=fields)
            longest = max(longest, time.perf_counter() - t0)
            while index.pending:
                t0 = time.perf_counter()
                index.work()
                longest = max(longest, time.perf_counter() - t0)
    return longest


def _one(peers: int, keys: int, deltas: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not a secret
    held = _fleet(peers, keys, rng)
    # The workload's own millions of ints are not the index's: frozen, the
    # collector never walks them, and what it walks is the index's.
    gc.collect()
    gc.freeze()
    try:
        # Memory in one pass (tracemalloc slows every allocation), times in another.
        tracemalloc.start()
        measured = SourceIndex()
        _feed(measured, held, keys)
        memory = tracemalloc.get_traced_memory()[0]  # while it lives
        tracemalloc.stop()
        del measured
        gc.collect()
        index = SourceIndex()
        longest = _feed(index, held, keys)
        claims = sum(len(index.peer(f"peer-{p}").claims) for p in range(peers))
        spent = 0.0
        changed = 0
        for seq in range(1, deltas + 1):
            for p, fps in enumerate(held):
                add = [rng.getrandbits(64) for _ in range(DELTA // 2)]
                remove = [fps.pop() for _ in range(DELTA // 2)]
                fps.extend(add)
                fields = packed(add), packed(remove)
                t0 = time.perf_counter()
                index.delta(f"peer-{p}", EPOCH, seq, *fields)
                while index.pending:
                    index.work()
                spent += time.perf_counter() - t0
                changed += len(add) + len(remove)
        run = held[0][:96]
        wanted = run + [rng.getrandbits(64) for _ in range(32)]
        took = []
        for _ in range(CHOICES):
            t0 = time.perf_counter()
            index.choose(wanted, 0.0)
            took.append(time.perf_counter() - t0)
        return {  # the row's columns
            "bytes per claim": memory / claims,
            "us per changed fingerprint": spent / changed * 1e6,
            "us per choice (128 keys)": statistics.median(took) * 1e6,
            "longest call (ms)": longest * 1e3,
            "index (MiB)": memory / 2**20,
        }
    finally:
        gc.unfreeze()


def run(options: BenchOptions) -> SectionResult:
    """Feed an index as 16, 64 and 128 peers would; one row per fleet size."""
    keys = QUICK_KEYS if options.quick else KEYS
    deltas = QUICK_DELTAS if options.quick else DELTAS_PER_PEER
    repeats = 1 if options.quick else max(1, min(options.repeats, 3))
    rows: list[dict[str, Cell]] = []
    for peers in FLEETS:
        results = [_one(peers, keys, deltas, seed) for seed in range(repeats)]
        last = {k: Stat.of(r[k] for r in results) for k in results[0]}
        rows.append({"peers": peers, "keys each": keys, **last})
    note = (
        f"targets at {FLEETS[-1]} peers: <= {TARGET_BYTES} bytes a claim "
        f"(here {last['bytes per claim'].median:.0f}), <= {TARGET_CHANGE_US} us a changed "
        f"fingerprint (here {last['us per changed fingerprint'].median:.2f}), <= "
        f"{TARGET_CHOICE_US:g} us a choice (here {last['us per choice (128 keys)'].median:.1f})"
    )
    return SectionResult(rows=rows, notes=[note])
