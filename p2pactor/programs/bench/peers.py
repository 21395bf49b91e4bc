"""``p2pactor bench`` section ``peers``: many nodes as processes, each fetching from the others.

It runs the demo's machinery (:func:`p2pactor.programs.demo.run.run_demo`): N node
processes on loopback (ZeroMQ control, NIXL data over torch pools), every node
a producer of the conversations it served and a consumer of the others'.
Each node makes one request per other node (lookup, then fetch the hit prefix,
then a byte-for-byte check of every block), a few at a time; no key is left
pending or expiring, so every request is pure lookup + fetch work.

Reported, as medians over repeats (a fresh set of processes each) with
[min..max]: aggregate throughput (fetched bytes, and fetches, over the longest
node's wall time from ``go`` to its last answer), lookup and fetch latency p50
and p99 over every request of the run, and failures, which must be none
(every answer as expected, every block verified, every pin released, no
invariant broken in the replayed event logs).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
from pathlib import Path
from typing import Any

from p2pactor.programs.bench._control_common import nixl_missing, percentile
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat

__all__ = ["NAME", "NODES", "QUICK_NODES", "TITLE", "plan_for", "run"]

NAME = "peers"
"""The section's name."""

TITLE = "N nodes as processes on loopback, each fetching from every other"
"""What the section measures."""

NODES = 16
"""Node processes of a full run."""

QUICK_NODES = 4
"""Node processes of ``--quick``."""

BLOCK_LEN = 128 * 1024
"""Bytes per block."""


def plan_for(nodes: int, requests_per_peer: int = 1) -> Any:
    """The demo plan: each node fetches ``requests_per_peer`` conversations from each other."""
    from p2pactor.programs.demo.workload import DemoPlan  # noqa: PLC0415

    return DemoPlan(
        nodes=nodes,
        requests=requests_per_peer * (nodes - 1),
        system_prompts=4,
        prefix_blocks=8,
        suffix_blocks=8,
        new_blocks=0,
        block_len=BLOCK_LEN,
        pending_every=0,
        expire_every=0,
        concurrency=4,
        # 16 node processes dialing each other at once on a 2-core machine can
        # take longer than the default 30 s to shake hands; throughput is the
        # point here, not the handshake deadline.
        handshake_timeout=120.0,
    )


def run(options: BenchOptions) -> SectionResult:
    """Run the demo's N nodes ``repeats`` times (at most 2) and summarise."""
    from p2pactor.programs.demo.run import run_demo  # noqa: PLC0415

    missing = nixl_missing()
    if missing:
        return SectionResult(name=NAME, title=TITLE, skipped=missing)
    nodes = QUICK_NODES if options.quick else NODES
    repeats = max(1, min(options.repeats, 2))
    # Several requests per peer: the first to each peer also sets its session up.
    per_peer = 2
    plan = plan_for(nodes, per_peer)
    gbps: list[float] = []
    rates: list[float] = []
    lookup50: list[float] = []
    lookup99: list[float] = []
    fetch50: list[float] = []
    fetch99: list[float] = []
    failures = 0
    fetched = verified = requests = 0
    problems: list[str] = []
    for repeat in range(repeats):
        out = io.StringIO()
        log_dir = Path(options.work_dir) / f"peers-{repeat}"
        # The demo's progress bar goes to stderr; the bench prints its own table.
        with contextlib.redirect_stderr(io.StringIO()):
            report = run_demo(plan, log_dir=log_dir, out=out, timeout=600.0)
        if report.problems:
            # The work dir goes with the run: keep the failed run's event logs
            # and node stderr for `p2pactor replay --check`.
            kept = tempfile.mkdtemp(prefix="p2pactor-bench-peers-failed-")
            shutil.copytree(log_dir, kept, dirs_exist_ok=True)
            problems.append(f"repeat {repeat}: its event logs and stderr are kept in {kept}")
        problems += report.problems
        outcomes = [o for r in report.results for o in r["outcomes"]]
        wall = max((r["elapsed"] for r in report.results), default=0.0)
        blocks = sum(o["fetched"] for o in outcomes)
        fetches = sum(1 for o in outcomes if o["fetched"])
        requests += len(outcomes)
        fetched += blocks
        verified += sum(o["verified"] for o in outcomes)
        failures += sum(len(o["failures"]) for o in outcomes)
        if len(report.results) != nodes or not wall or not fetches:
            problems.append(f"repeat {repeat}: {len(report.results)} of {nodes} nodes reported")
            continue
        gbps.append(blocks * plan.block_len / wall / 1e9)
        rates.append(fetches / wall)
        lookups = [o["lookup_s"] * 1e3 for o in outcomes]
        fetch_ms = [o["fetch_s"] * 1e3 for o in outcomes if o["fetched"]]
        lookup50.append(percentile(lookups, 0.5))
        lookup99.append(percentile(lookups, 0.99))
        fetch50.append(percentile(fetch_ms, 0.5))
        fetch99.append(percentile(fetch_ms, 0.99))
    failed = failures + len(problems) + (fetched - verified)

    def stat(values: list[float]) -> Stat | None:
        return Stat.of(values) if values else None

    row: dict[str, Cell] = {
        "nodes": nodes,
        "requests": requests,
        "MiB fetched": fetched * plan.block_len / 2**20,
        "GB/s": stat(gbps),
        "fetches/s": stat(rates),
        "lookup p50 ms": stat(lookup50),
        "lookup p99 ms": stat(lookup99),
        "fetch p50 ms": stat(fetch50),
        "fetch p99 ms": stat(fetch99),
        "verified": f"{verified}/{fetched}",
        "failures": failed,
    }
    kib = plan.block_len // 1024
    notes = [
        (
            f"{repeats} repeats; each node makes {per_peer} requests per other node "
            "(the first also sets the session up), "
            f"{plan.prefix_blocks + plan.suffix_blocks} blocks of {kib} KiB per fetch, "
            f"{plan.concurrency} at a time; aggregate = all nodes' bytes over the longest "
            "node's time"
        ),
        f"{verified} of {fetched} fetched blocks verified byte for byte; {failed} failures",
    ]
    notes += [f"problem: {p}" for p in problems[:12]]
    if failed:
        notes.insert(
            0,
            f"FAILURES: {failed} (requests not answered as expected; the node stderr "
            "and event logs of a failed repeat are kept: see the problem notes)",
        )
    # Failures are a figure this section reports (the JSON has them); only
    # wrong bytes, or a run with nothing fetched, make the section itself fail.
    broken = fetched - verified or not fetched
    skipped = f"failed: {failed} failures ({problems[:1] or 'see notes'})" if broken else None
    return SectionResult(
        name=NAME, title=TITLE, rows=[row], ratios={}, notes=notes, skipped=skipped
    )
