"""``p2pactor bench`` section ``hosts``: the data-plane fetch across two hosts, over UCX TCP.

Two namespaced hosts (:mod:`p2pactor.programs.hosts`: each its own network,
hostname and ``/dev/shm``, UCX limited to ``tcp,self`` on its ``eth0``) are
joined by a veth pair and a bridge, so the bytes cross the kernel's TCP stack
as between machines. The measurement is the ``dataplane`` section's own
(:func:`p2pactor.programs.bench.dataplane._measure_group`), run in a consumer
process on ``h1`` with its producer process on ``h2``
(:mod:`p2pactor.programs.bench._hosts_peer`). Side by side in each repeat:

* **ours**: ``node.lookup`` then ``node.fetch`` of B blocks of S bytes through
  the two nodes, byte-checked;
* **raw NIXL**: the same WRITE, same blocks, between the same two processes,
  from bare NIXL agents over the same UCX TCP path: what TCP over veth reaches
  here.

The table shows GB/s and ours/raw as the median over repeats with
[min..max]. Then the lookup latency: a loop of single-key lookups from a node
on ``h1`` to a node on ``h2``, against the same loop between two nodes on
``127.0.0.1``; p50 and p99 per repeat. Needs root (namespaces); without it the
section is skipped with a note.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pactor.programs.bench._control_common import nixl_missing, percentile
from p2pactor.programs.bench._dataplane_peer import PREFIX
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat
from p2pactor.programs.hosts import Host, hosts_unavailable, open_hosts

NAME = "hosts"
"""The section's name."""

TITLE = "fetch B x S across two namespaced hosts over UCX TCP (veth), vs raw NIXL"
"""What the section measures."""

KIB = 1024
MIB = 1024 * KIB

SIZES: tuple[tuple[int, int], ...] = ((64, MIB), (256, MIB))
"""(blocks, bytes per block) of a full run."""

QUICK_SIZES: tuple[tuple[int, int], ...] = ((16, 256 * KIB),)
"""(blocks, bytes per block) of ``--quick``: one small batch."""

TARGET = 0.9
"""ours / raw NIXL wanted across hosts for batches of 64 x 1 MiB and up."""

SKIP = "no namespaced hosts"
"""How the section's skip note starts (``tests/test_bench.py`` allows it)."""


def _label(count: int, block_len: int) -> str:
    size = f"{block_len // MIB} MiB" if block_len >= MIB else f"{block_len // KIB} KiB"
    return f"{count} x {size}"


def _peer(host: Host | None) -> dict[str, str] | None:
    return (
        None if host is None else {"name": host.name, "netns": host.netns, "address": host.address}
    )


def _ask(
    role: str, spec: dict[str, Any], on: Host | None, work_dir: str, timeout: float
) -> dict[str, Any]:
    """Run a :mod:`~p2pactor.programs.bench._hosts_peer` role (on ``on``); its one line."""
    argv = [sys.executable, "-m", "p2pactor.programs.bench._hosts_peer", role, json.dumps(spec)]
    where = "loopback" if on is None else on.name
    stderr_path = Path(work_dir) / f"hosts-{role}-{where}.stderr"
    with stderr_path.open("wb") as stderr:
        done = subprocess.run(  # noqa: S603 - our own interpreter and module
            argv if on is None else on.command(argv),
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=None if on is None else on.env(),
            timeout=timeout,
            check=False,
        )
    for line in done.stdout.decode(errors="replace").splitlines():
        if line.startswith(PREFIX):
            message: dict[str, Any] = json.loads(line[len(PREFIX) :])
            if message.get("event") == role:
                return message
    tail = stderr_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"the {role} process on {where} exited {done.returncode}: {tail}")


def _lookup_stats(runs: Sequence[Sequence[float]]) -> tuple[Stat, Stat]:
    """p50 and p99 (ms) per repeat, as statistics over repeats."""
    p50 = Stat.of(percentile(r, 0.5) for r in runs).scaled(1e3)
    p99 = Stat.of(percentile(r, 0.99) for r in runs).scaled(1e3)
    return p50, p99


def run(options: BenchOptions) -> SectionResult:
    """Measure every size of :data:`SIZES` (:data:`QUICK_SIZES` with ``--quick``) across hosts."""
    missing = hosts_unavailable()
    if missing:
        return SectionResult(name=NAME, title=TITLE, skipped=f"{SKIP}: {missing}")
    missing = nixl_missing()
    if missing:
        return SectionResult(name=NAME, title=TITLE, skipped=missing)
    sizes = QUICK_SIZES if options.quick else SIZES
    groups: dict[int, list[int]] = {}
    for count, block_len in sizes:
        groups.setdefault(block_len, []).append(count)
    iters = 4 if options.quick else 10
    lookups = {"count": 200 if options.quick else 1000, "warmup": 50, "repeats": options.repeats}
    measured: dict[tuple[int, int], dict[str, Any]] = {}
    with open_hosts(2) as (h1, h2):
        for block_len, counts in groups.items():
            spec = {
                "address": h1.address,
                "peer": _peer(h2),
                "block_len": block_len,
                "counts": counts,
                "repeats": options.repeats,
                "iters": iters,
                "work_dir": options.work_dir,
            }
            found = _ask("fetch", spec, h1, options.work_dir, 120 if options.quick else 400)
            measured.update({(int(c), block_len): m for c, m in found["measured"].items()})
        across = _ask(
            "lookups",
            {**lookups, "address": h1.address, "peer": _peer(h2), "work_dir": options.work_dir},
            h1,
            options.work_dir,
            120,
        )["runs"]
    loopback = _ask(
        "lookups",
        {**lookups, "address": "127.0.0.1", "peer": None, "work_dir": options.work_dir},
        None,
        options.work_dir,
        120,
    )["runs"]
    rows: list[dict[str, Cell]] = []
    ratios: dict[str, Stat] = {}
    missed: list[str] = []
    notes: list[str] = [
        (
            f"h1 -> h2 over UCX_TLS=tcp,self on eth0 (a veth pair and a bridge); ours = lookup + "
            f"fetch through the Node API, fetch only = fetch to transfer_done, raw NIXL = the same "
            f"WRITE from bare agents in the same two processes; {options.repeats} repeats of "
            f"{iters} operations each"
        )
    ]
    for count, block_len in sizes:
        m = measured[count, block_len]
        label = _label(count, block_len)
        ours_raw = Stat.of(m["ours_raw"])
        rows.append(
            {
                "batch": label,
                "MiB": count * block_len / MIB,
                "ours GB/s": Stat.of(m["ours"]),
                "fetch only GB/s": Stat.of(m["fetch"]),
                "raw NIXL GB/s": Stat.of(m["raw"]),
                "ours/raw": ours_raw,
                "fetch/raw": Stat.of(m["fetch_raw"]),
                "producer stall ms": Stat.of(m["stall_ms"]),
            }
        )
        ratios[f"ours/raw across hosts {label}"] = ours_raw
        ratios[f"fetch only/raw across hosts {label}"] = Stat.of(m["fetch_raw"])
        phases: dict[str, list[float]] = m["phases"]
        if phases:
            parts = ", ".join(
                f"{p} {statistics.median(v) * 1e3:.2f}" for p, v in phases.items() if v
            )
            notes.append(f"{label} where ours spends its time (median ms): {parts}")
        if count * block_len >= 64 * MIB and ours_raw.median < TARGET:
            missed.append(f"{label} at {ours_raw.median:.2f}")
    if any(count * block_len >= 64 * MIB for count, block_len in sizes):
        if missed:
            notes.append(
                f"target ours/raw >= {TARGET} for 64 x 1 MiB and up missed: " + "; ".join(missed)
            )
        else:
            notes.append(f"target ours/raw >= {TARGET} for 64 x 1 MiB and up: met")
    a50, a99 = _lookup_stats(across)
    l50, l99 = _lookup_stats(loopback)
    ratios["lookup p50 hosts/loopback"] = Stat.of(
        percentile(a, 0.5) / percentile(b, 0.5) for a, b in zip(across, loopback, strict=True)
    )
    ratios["lookup p99 hosts/loopback"] = Stat.of(
        percentile(a, 0.99) / percentile(b, 0.99) for a, b in zip(across, loopback, strict=True)
    )
    notes.append(
        f"single-key lookup latency, {lookups['count']} per repeat: across hosts p50 "
        f"{a50.text(3)} ms, p99 {a99.text(3)} ms; on 127.0.0.1 p50 {l50.text(3)} ms, "
        f"p99 {l99.text(3)} ms"
    )
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)
