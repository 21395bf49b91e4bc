"""The WARNING a session writes when a peer never fetched what its lookups pinned."""

from __future__ import annotations

import logging
import math

from p2pactor.core import events as ev
from p2pactor.runtime.logcontext import request_context

log = logging.getLogger("p2pactor.session")

# At most one line per session this often: a peer that never fetches expires many pins.
INTERVAL_S = 10.0


class ExpiryWarnings:
    """Says at WARNING, at most once per :data:`INTERVAL_S`, that pins of a peer's expired."""

    __slots__ = ("_logged_at", "_node_id", "_peer_id", "_unlogged")

    def __init__(self, peer_id: str, node_id: str) -> None:
        self._peer_id = peer_id
        self._node_id = node_id
        self._logged_at = -math.inf
        self._unlogged = 0

    def pin_expired(self, kv_request_id: str, event: ev.PinReleased) -> None:
        """Say that the peer never fetched the blocks ``event`` released (or only count it)."""
        now = event.at
        if now < self._logged_at + INTERVAL_S:
            self._unlogged += 1
            return
        more, self._unlogged = self._unlogged, 0
        self._logged_at = now
        log.warning(
            "%s never fetched the blocks its lookup for %s pinned: released pin %d (%s)%s; "
            "a peer that looks up and does not fetch holds blocks for nothing (check that it "
            "runs p2pactor or vLLM's tier, and that its fetches reach this node)",
            self._peer_id,
            kv_request_id,
            event.job_id,
            event.reason,
            f"; {more} more such releases since the last line" if more else "",
            extra=request_context(self._peer_id, kv_request_id, node=self._node_id),
        )
