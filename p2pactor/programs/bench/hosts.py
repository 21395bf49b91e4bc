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
[min..max]. Needs root (namespaces); without it the section is skipped with a note.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from p2pactor.programs.bench._control_common import child_result, nixl_missing
from p2pactor.programs.bench.dataplane import KIB, MIB, by_block_len, tabulate
from p2pactor.programs.bench.report import BenchOptions, SectionResult
from p2pactor.programs.hosts import hosts_unavailable, open_hosts

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


def run(options: BenchOptions) -> SectionResult:
    """Measure every size of :data:`SIZES` (:data:`QUICK_SIZES` with ``--quick``) across hosts."""
    missing = hosts_unavailable()
    if missing:
        return SectionResult(name=NAME, title=TITLE, skipped=f"{SKIP}: {missing}")
    missing = nixl_missing()
    if missing:
        return SectionResult(name=NAME, title=TITLE, skipped=missing)
    sizes = QUICK_SIZES if options.quick else SIZES
    iters = 4 if options.quick else 10
    measured: dict[tuple[int, int], dict[str, Any]] = {}
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
            }
            found = child_result(
                "p2pactor.programs.bench.dataplane",
                json.dumps(spec),
                stderr=f"{options.work_dir}/hosts-consumer-{block_len}.stderr",
                host=h1,
                timeout=120 if options.quick else 400,
            )
            measured.update({(c, block_len): found[str(c)] for c in counts})
    rows, ratios, notes = tabulate(sizes, measured, 64 * MIB, " across hosts")
    notes.insert(
        0,
        f"h1 -> h2 over UCX_TLS=tcp,self on eth0 (a veth pair and a bridge); ours = lookup + "
        f"fetch through the Node API, fetch only = fetch to transfer_done, raw NIXL = the same "
        f"WRITE from bare agents in the same two processes; {options.repeats} repeats of "
        f"{iters} operations each",
    )
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)
