"""The demo's summary: the table of every node's requests, and the lines under it.

Read from each node's ``done`` message (its requests' outcomes, its session
setup time); what went wrong is added to the run's problems.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from p2pactor.programs.demo.workload import DemoPlan

__all__ = ["NodeResult", "summarise"]

NodeResult = tuple[int, str, dict[str, Any] | None]
"""A node's index, its id and its ``done`` message (None: it never finished)."""


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarise(
    plan: DemoPlan, nodes: Sequence[NodeResult], out: TextIO, problems: list[str]
) -> None:
    """Print the summary table and its lines to ``out``; add what went wrong to ``problems``."""
    header = (
        f"{'node':<18}{'reqs':>5}{'keys':>6}{'hit':>5}{'miss':>5}{'pend':>5}{'exp':>5}"
        f"{'blocks':>7}{'MiB':>8}{'GB/s':>7}{'lookup p50/p99 ms':>19}{'fetch p50/p99 ms':>18}"
        f"{'fail':>5}"
    )
    out.write("\n" + header + "\n" + "-" * len(header) + "\n")
    all_lookups: list[float] = []
    all_waited: list[float] = []
    all_fetches: list[float] = []
    totals = dict.fromkeys(("reqs", "keys", "hits", "misses", "pending", "expired", "blocks"), 0)
    total_fetch_s = 0.0
    total_failures = 0
    for index, node_id, result in nodes:
        if result is None:
            continue
        outcomes = result["outcomes"]
        # A lookup of a key still being written waits for the write (or the
        # 5 s deadline): that is the producer's time, shown on its own line.
        lookups = [o["lookup_s"] * 1000 for o in outcomes if not _waited(o)]
        all_waited += [o["lookup_s"] * 1000 for o in outcomes if _waited(o)]
        fetches = [o["fetch_s"] * 1000 for o in outcomes if o["fetched"]]
        all_lookups += lookups
        all_fetches += fetches
        row = {
            "reqs": len(outcomes),
            "keys": sum(o["hits"] + o["misses"] for o in outcomes),
            "hits": sum(o["hits"] for o in outcomes),
            "misses": sum(o["misses"] for o in outcomes),
            "pending": sum(o["pending"] for o in outcomes),
            "expired": sum(o["expired"] for o in outcomes),
            "blocks": sum(o["fetched"] for o in outcomes),
        }
        fetch_s = sum(o["fetch_s"] for o in outcomes)
        failures = [f for o in outcomes for f in o["failures"]]
        unverified = sum(o["fetched"] - o["verified"] for o in outcomes)
        for key in totals:
            totals[key] += row[key]
        total_fetch_s += fetch_s
        total_failures += len(failures)
        problems.extend(f"node {index} {f}" for f in failures)
        if unverified:
            problems.append(f"node {index}: {unverified} fetched blocks not verified")
        latencies = (lookups, fetches)
        out.write(
            _row(
                node_id,
                row,
                plan.block_len,
                fetch_s=fetch_s,
                latencies=latencies,
                failures=len(failures),
            )
        )
    out.write("-" * len(header) + "\n")
    out.write(
        _row(
            "total",
            totals,
            plan.block_len,
            fetch_s=total_fetch_s,
            latencies=(all_lookups, all_fetches),
            failures=total_failures,
        )
    )
    verified = totals["blocks"] - sum(
        o["fetched"] - o["verified"] for _, _, r in nodes if r for o in r["outcomes"]
    )
    out.write(
        f"\n{verified} of {totals['blocks']} fetched blocks verified byte for byte; "
        f"pending keys resolved to hits, expired ones answered miss after 5 s.\n"
    )
    if all_waited:
        out.write(
            f"Lookup latencies are of stored keys; the {len(all_waited)} requests with a key "
            "still being written waited for it (p50 "
            f"{_percentile(all_waited, 0.5):.0f} ms, max {max(all_waited):.0f} ms).\n"
        )
    results = [r for _, _, r in nodes if r is not None]
    out.write(_setup_line(plan, results, problems))
    if not plan.named:
        out.write(_sources_line([o for r in results for o in r["outcomes"]]))


def _waited(outcome: dict[str, Any]) -> bool:
    """Whether the request's lookup waited for a key being written."""
    return bool(outcome["pending"] or outcome["expired"])


def _setup_line(plan: DemoPlan, results: list[dict[str, Any]], problems: list[str]) -> str:
    """How long the sessions took to open, apart from the lookups they carry."""
    problems.extend(
        f"node {r['index']} had no ready session with every peer within "
        f"{plan.handshake_timeout:g} s"
        for r in results
        if not r["sessions_ready"]
    )
    slowest = max((r["setup_s"] for r in results), default=0.0)
    what = "sessions" if plan.named else "sessions and read their summaries"
    return (
        f"Setup: each node opened {what} with its {plan.nodes - 1} peers in "
        f"{slowest * 1000:.0f} ms at most, before its first request (not in the lookup "
        "latencies above).\n"
    )


def _sources_line(outcomes: list[dict[str, Any]]) -> str:
    """What the requests that named no source found."""
    found = [o for o in outcomes if o["found"]]
    other = sum(1 for o in outcomes if o["source"] is not None and not o["found"])
    nobody = sum(1 for o in outcomes if o["source"] is None)
    line = (
        f"Sources: no request named one; {len(found)} of {len(outcomes)} found the peer that "
        f"served their conversation in the peers' summaries ({sum(o['hits'] for o in found)} "
        "hits), with no router"
    )
    if other:
        line += f"; {other} chose another peer"
    if nobody:
        line += f"; {nobody} found no peer claiming their first block"
    return line + ".\n"


def _row(
    name: str,
    row: dict[str, int],
    block_len: int,
    *,
    fetch_s: float,
    latencies: tuple[list[float], list[float]],
    failures: int,
) -> str:
    lookups, fetches = latencies
    mib = row["blocks"] * block_len / 2**20
    gbps = row["blocks"] * block_len / fetch_s / 1e9 if fetch_s else 0.0
    lookup = f"{_percentile(lookups, 0.5):.1f}/{_percentile(lookups, 0.99):.1f}"
    fetch = f"{_percentile(fetches, 0.5):.1f}/{_percentile(fetches, 0.99):.1f}"
    return (
        f"{name:<18}{row['reqs']:>5}{row['keys']:>6}{row['hits']:>5}{row['misses']:>5}"
        f"{row['pending']:>5}{row['expired']:>5}{row['blocks']:>7}{mib:>8.1f}{gbps:>7.2f}"
        f"{lookup:>19}{fetch:>18}{failures:>5}\n"
    )
