"""What the engine is about to hold, claimed as vLLM begins to write it (part of the vLLM adapter).

vLLM cascades a store to its tiers one step after the store completed in its
CPU tier: told only then, a peer hears of a block a step after the engine
holds it, and a request for it on another engine in between prefills what
this one just computed (in the fleet benchmark, most of what automatic choice
missed of an oracle's).

The tier knows earlier what its engine will hold: vLLM asks it about a
request's keys only past the CPU tier's hits, and every key from the first it
asks is one the engine computes or loads. So :class:`Watch` follows each such
request's keys, in prompt order. At each step's serve (vLLM's
``on_schedule_end``, right after it prepared the step's stores and allocated
its promotions), it looks the next unclaimed key of every followed request up
in the CPU tier alone: from there, the run the tier holds or is writing
(HIT_PENDING) is claimed at once, ranked as the request's, and the summary's
delta goes out now. A peer that asks meanwhile hears HIT_PENDING from vLLM's
own CPU tier until the write completes, then HIT; a write that fails leaves a
MISS, which drops the claim as any other. A key no store comes for (the
request ended first, its store was skipped) is never claimed.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from typing import Any

from p2pactor.adapters._vllm_api import PRIMARY_ONLY, ParentManager, ReqContext, VllmLookup
from p2pactor.runtime.node import Node

_MOST_REQUESTS = 4096  # followed at once; a request past that is claimed at its cascade only
_ids = itertools.count(1)


class _Followed:
    __slots__ = ("keys", "next", "positions")

    def __init__(self, keys: list[bytes], positions: list[int]) -> None:
        self.keys = keys
        self.positions = positions
        self.next = 0  # the first key not claimed yet


class Watch:
    """The requests whose keys are claimed as vLLM writes them.

    Args:
        node: The tier's node (its summary).
    """

    def __init__(self, node: Node) -> None:
        self._node = node
        self._followed: dict[str, _Followed] = {}

    def __len__(self) -> int:
        return len(self._followed)

    def follow(self, req_id: str, record: Mapping[bytes, int], first: int) -> None:
        """Follow ``req_id``'s keys from end-token position ``first`` on (the first it asked)."""
        if not self._node.shares_summaries or len(self._followed) >= _MOST_REQUESTS:
            return
        ahead = sorted((p, k) for k, p in record.items() if p >= first)
        if ahead:
            self._followed[req_id] = _Followed([k for _, k in ahead], [p for p, _ in ahead])

    def finished(self, req_id: str) -> None:
        """The request ended: its cascade, if any, has come (vLLM finishes it after)."""
        self._followed.pop(req_id, None)

    def check(self, parent: ParentManager, loading: Collection[bytes] = ()) -> None:
        """Claim what the CPU tier now holds or writes of every followed request (lent parent).

        One CPU-tier lookup per followed request, and one more per key passed.
        Keys in ``loading`` (this tier's own loads in flight) are passed over
        unclaimed: the load's end claims them, and until then the chunks it
        took are counted apart (``Node.reserve``).
        """
        if not self._followed:
            return
        ctx = ReqContext(
            req_id=f"p2pactor-watch-{self._node.node_id}-{next(_ids)}",
            kv_transfer_params=None,
            load_tier_filter=PRIMARY_ONLY,
        )
        parent.on_new_request(ctx)
        try:
            done = []
            for req_id, followed in self._followed.items():
                start = followed.next
                keys = followed.keys
                while followed.next < len(keys) and _there(parent.lookup(keys[followed.next], ctx)):
                    followed.next += 1
                claim = [i for i in range(start, followed.next) if keys[i] not in loading]
                if claim:
                    self._node.holds(
                        [keys[i] for i in claim],
                        request=req_id,
                        positions=[followed.positions[i] for i in claim],
                        now=True,
                    )
                if followed.next == len(keys):
                    done.append(req_id)
            for req_id in done:
                del self._followed[req_id]
        finally:
            parent.on_request_finished(ctx)


def _there(result: Any) -> bool:
    # HIT, or HIT_PENDING: vLLM is writing it (its store, or a promotion).
    return result is not VllmLookup.MISS
