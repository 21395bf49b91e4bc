"""``p2pactor bench`` section ``hosts``: the data-plane fetch across two hosts, over UCX TCP.

Two namespaced hosts (:mod:`p2pactor.programs.hosts`, joined by a veth pair and a
bridge: the bytes cross the kernel's TCP stack as between machines) run the
``dataplane`` section's own measurement (:func:`p2pactor.programs.bench.dataplane.measure`),
its consumer on ``h1``, its producer on ``h2``. Needs root; else skipped with a note.
"""

from __future__ import annotations

from p2pactor.programs.bench._control_common import nixl_missing
from p2pactor.programs.bench.cli import BenchOptions, SectionResult
from p2pactor.programs.bench.dataplane import KIB, MIB, measure_sizes
from p2pactor.programs.hosts import hosts_unavailable, open_hosts

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
    if missing := hosts_unavailable():
        return SectionResult(skipped=f"{SKIP}: {missing}")
    if missing := nixl_missing():
        return SectionResult(skipped=missing)
    with open_hosts(2) as hosts:
        sizes, iters = (QUICK_SIZES, 4) if options.quick else (SIZES, 10)
        return measure_sizes(sizes, iters, options, hosts)
