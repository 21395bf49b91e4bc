"""vLLM 0.33's own offloading stack around a secondary tier, and an engine that drives it.

What the tests and benchmarks of the vLLM tier run on instead of a picture of
vLLM: :func:`build_stack` builds an engine's stack with vLLM's own
``TieringOffloadingSpec.get_manager()`` (its CPU tier with vLLM's LRU, its
tier-poll thread, the secondary tiers made by ``SecondaryTierFactory`` from
their ``secondary_tiers`` entries), and :class:`StackEngine` makes the calls
vLLM's ``OffloadingConnectorScheduler`` makes of it, step by step (what it
leaves out is said in :mod:`~p2pactor.programs.vllmstack.engine`). Importing
it needs vLLM.
"""

from p2pactor.programs.vllmstack.build import (
    Stack,
    StackOptions,
    build_stack,
    spec_of,
    tier_entry,
)
from p2pactor.programs.vllmstack.engine import Phase, StackEngine, StackRequest, fill

__all__ = [
    "Phase",
    "Stack",
    "StackEngine",
    "StackOptions",
    "StackRequest",
    "build_stack",
    "fill",
    "spec_of",
    "tier_entry",
]
