"""Requests that name no source: the tier finds one from its peers' summaries.

A part of the vLLM adapter. vLLM asks the tier about a request's keys in
order, after its own CPU tier missed them, and keeps asking past a RETRY
until the first MISS (``_maximal_prefix_lookup``). So, for a request whose
``kv_transfer_params`` name no source:

- the first key no live peer claims (one dict lookup) is a MISS at once, and
  the request goes on to prefill locally in the same step, with no wait;
- a claimed key is a RETRY and is kept, as are ``tail_keys`` unclaimed keys
  after the claimed run (stores the peer made since its last delta);
- at the step's end the kept keys go to the node, which chooses the peer and
  sends it one ordinary lookup (:meth:`~p2pactor.runtime.node.Node.locate_soon`);
- once the choice is published the request becomes that peer's, exactly as
  if named (:class:`~p2pactor.adapters._vllm_api.Source`): its answers,
  ``submit_load`` and finish take the named path, for the keys the peer was
  asked (any other is a MISS: nobody claimed it). A choice of nobody (the
  claims were not worth a round trip, or the peer is quarantined) answers
  MISS from then on.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs

from p2pactor.adapters._vllm_api import ReqContext, Source
from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.runtime.node import Node


@attrs.define(eq=False)
class Auto:
    """A request that named no source (its ``ReqContext`` state) while a source is chosen.

    Attributes:
        kv_request_id: The id its lookups carry (this node's own).
        keys: The keys kept for the choice, in the order vLLM asked them.
        past_run: Unclaimed keys kept after the claimed run.
        handed: The keys went to the node; the choice is awaited.
        settled: No source: every key is a MISS.
        undecided_at: The step in which a key was answered RETRY for want of
            the choice. A choice published later in that step waits for the
            next: vLLM promotes every HIT it hears and scans on past a RETRY,
            so a choice landing mid-scan would fetch the run without its head.
    """

    kv_request_id: str
    keys: dict[bytes, None] = attrs.Factory(dict)
    past_run: int = 0
    handed: bool = False
    settled: bool = False
    undecided_at: int = -1


class AutoSources:
    """What the tier does for the requests that name no source.

    Args:
        node: The tier's node.
        tail_keys: Unclaimed keys asked past a claimed run.
    """

    def __init__(self, node: Node, tail_keys: int) -> None:
        self._node = node
        self._tail = tail_keys
        self._prefix = f"auto:{node.node_id}:"
        self._kept: list[Auto] = []  # kept keys this step, handed over at its end
        self._steps = 0  # steps ended
        self.unclaimed = 0
        """Requests whose first key no peer claimed: a MISS at once (engine thread's count)."""

    def begin(self, req_context: ReqContext) -> None:
        """A request naming no source: find one, if this node shares summaries."""
        if self._node.config.sources.share:
            req_context.set_state(Auto(self._prefix + str(req_context.req_id)))

    def lookup(self, auto: Auto, key: Any, req_context: ReqContext) -> Answer | Source:
        """The answer for ``key`` while a source is chosen; once it is, the source (ask it)."""
        if auto.settled:
            return Answer.MISS
        if auto.handed:
            if auto.undecided_at == self._steps:
                return Answer.RETRY  # as at this scan's first key: see ``undecided_at``
            decision = self._node.decision(auto.kv_request_id)
            if decision is None:
                auto.undecided_at = self._steps
                return Answer.RETRY
            if decision.chosen is None:
                auto.settled = True
                return Answer.MISS
            asked = frozenset(itertools.islice(auto.keys, decision.keys))
            source = Source(decision.chosen, auto.kv_request_id, probe=True, only=asked)
            req_context.set_state(source)  # from now on it is named
            return source
        k = bytes(key)
        if auto.past_run or not self._node.claimed(k):
            if not auto.keys:
                auto.settled = True  # nobody claims the first key we are asked: prefill now
                self.unclaimed += 1
                return Answer.MISS
            if auto.past_run >= self._tail:
                return Answer.MISS
            auto.past_run += 1
        if not auto.keys:
            self._kept.append(auto)
        auto.keys[k] = None
        return Answer.RETRY

    def step_ended(self) -> None:
        """Hand the keys kept this step to the node, one choice per request."""
        self._steps += 1
        kept, self._kept = self._kept, []
        for auto in kept:
            if not auto.handed and not auto.settled:
                auto.handed = True
                self._node.locate_soon(auto.kv_request_id, list(auto.keys))

    def finished(self, auto: Auto) -> None:
        """The request ended before it became a named one: forget its choice."""
        if auto.handed:
            self._node.finish(auto.kv_request_id, wake=False)
        auto.settled = True
