"""``p2pactor bench`` section ``hosts``: the data-plane fetch across two hosts, over UCX TCP.

Two namespaced hosts (:mod:`p2pactor.programs.hosts`: each its own network,
hostname and ``/dev/shm``, UCX limited to ``tcp,self`` on its ``eth0``) are
joined by a veth pair and a bridge, so the bytes cross the kernel's TCP stack
as between machines. The measurement is the ``dataplane`` section's own
(:func:`p2pactor.programs.bench.dataplane.measure`), its consumer process on
``h1`` and its producer process on ``h2``. Side by side in each repeat:

* **ours**: ``node.lookup`` then ``node.fetch`` of B blocks of S bytes through
  the two nodes, byte-checked;
* **raw NIXL**: the same WRITE, same blocks, between the same two processes,
  from bare NIXL agents over the same UCX TCP path: what TCP over veth reaches
  here.

The table shows GB/s and ours/raw as the median over repeats with
[min..max]. Then the lookup latency: a loop of single-key lookups from the node
on ``h1`` to the node on ``h2``, against the same loop between two nodes on
``127.0.0.1``; p50 and p99 per repeat. Needs root (namespaces); without it the
section is skipped with a note.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from p2pactor.programs.bench._control_common import child_result, nixl_missing, percentile
from p2pactor.programs.bench.dataplane import KIB, MIB, by_block_len, tabulate
from p2pactor.programs.bench.report import BenchOptions, SectionResult, Stat
from p2pactor.programs.hosts import Host, hosts_unavailable, open_hosts

NAME = "hosts"
"""The section's name."""
TITLE = "fetch B x S across two namespaced hosts over UCX TCP (veth), vs raw NIXL"
"""What the section measures."""

SIZES: tuple[tuple[int, int], ...] = ((64, MIB), (256, MIB))
"""(blocks, bytes per block) of a full run."""
QUICK_SIZES: tuple[tuple[int, int], ...] = ((16, 256 * KIB),)
"""(blocks, bytes per block) of ``--quick``: one small batch."""
SKIP = "no namespaced hosts"
"""How the section's skip note starts (``tests/test_bench.py`` allows it)."""


def _on(host: Host | None, spec: dict[str, Any], timeout: float) -> Any:
    """:func:`~p2pactor.programs.bench.dataplane.measure` of ``spec``, in a process on ``host``.

    ``None``: on this machine's loopback, a fresh process too (a like reference).
    """
    where = "loopback" if host is None else host.name
    stderr = f"{spec['work_dir']}/hosts-consumer-{spec['block_len']}-{where}.stderr"
    module = "p2pactor.programs.bench.dataplane"
    return child_result(module, json.dumps(spec), stderr=stderr, host=host, timeout=timeout)


def run(options: BenchOptions) -> SectionResult:
    """Measure every size of :data:`SIZES` (:data:`QUICK_SIZES` with ``--quick``) across hosts."""
    missing = hosts_unavailable()
    if missing:
        return SectionResult(name=NAME, title=TITLE, skipped=f"{SKIP}: {missing}")
    missing = nixl_missing()
    if missing:
        return SectionResult(name=NAME, title=TITLE, skipped=missing)
    sizes = QUICK_SIZES if options.quick else SIZES
    iters, lookups = (4, 200) if options.quick else (10, 1000)
    measured: dict[tuple[int, int], dict[str, Any]] = {}
    across: list[list[float]] = []
    with open_hosts(2) as (h1, h2):
        for block_len, counts in by_block_len(sizes).items():
            spec = {
                "block_len": block_len,
                "counts": counts,
                "repeats": options.repeats,
                "iters": iters,
                "work_dir": options.work_dir,
                "address": h1.address,
                "host": attrs.asdict(h2),
                "lookups": 0 if across else lookups,  # with the first group only
            }
            found = _on(h1, spec, 120 if options.quick else 400)
            measured.update({(c, block_len): found["measured"][str(c)] for c in counts})
            across = across or found["lookups"]
    reference = {**spec, "block_len": 4096, "counts": [], "address": "127.0.0.1", "host": None}
    loopback: list[list[float]] = _on(None, reference | {"lookups": lookups}, 120)["lookups"]
    rows, ratios, notes = tabulate(sizes, measured, 64 * MIB, " across hosts")
    notes.insert(
        0,
        f"h1 -> h2 over UCX_TLS=tcp,self on eth0 (a veth pair and a bridge); ours = lookup + "
        f"fetch through the Node API, fetch only = fetch to transfer_done, raw NIXL = the same "
        f"WRITE from bare agents in the same two processes; {options.repeats} repeats of "
        f"{iters} operations each",
    )
    pairs = list(zip(across, loopback, strict=True))
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        ratios[f"lookup {name} hosts/loopback"] = Stat.of(
            percentile(a, q) / percentile(b, q) for a, b in pairs
        )
    a50, a99, l50, l99 = (
        Stat.of(percentile(r, q) for r in runs).scaled(1e3).text(3)
        for runs in (across, loopback)
        for q in (0.5, 0.99)
    )
    notes.append(
        f"single-key lookup latency, {lookups} per repeat: across hosts p50 {a50} ms, p99 "
        f"{a99} ms; on 127.0.0.1 p50 {l50} ms, p99 {l99} ms"
    )
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)
