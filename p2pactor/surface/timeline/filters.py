"""What a subscriber asks to see: its filters, parsed from the ``/events`` query."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

import attrs

from p2pactor.core import events as ev
from p2pactor.errors import P2PActorError

__all__ = ["BadFilter", "FeedFilters"]


class BadFilter(P2PActorError, ValueError):
    """A subscriber asked for a filter the feed cannot apply (an unknown event kind)."""


@attrs.frozen(kw_only=True)
class FeedFilters:
    """What a subscriber wants to see; None lets everything through.

    Attributes:
        peer: Only actors whose peer is this ``host:port``.
        request: Only actors of this kv_request_id.
        kinds: Only events of these kinds (``LookupResp``, ``FetchSent``...).
    """

    peer: str | None = None
    request: str | None = None
    kinds: frozenset[str] | None = None

    @classmethod
    def from_query(cls, query: str) -> FeedFilters:
        """Parse ``peer=...&request=...&kinds=A,B`` (each optional, empty means none).

        Raises:
            BadFilter: ``kinds`` names an event kind that does not exist.
        """
        fields = parse_qs(query, keep_blank_values=False)

        def last(name: str) -> str | None:
            values = fields.get(name)
            return values[-1] if values else None

        kinds: frozenset[str] | None = None
        raw_kinds = [k.strip() for v in fields.get("kinds", ()) for k in v.split(",")]
        if any(raw_kinds):
            kinds = frozenset(k for k in raw_kinds if k)
            unknown = sorted(kinds - ev.EVENT_TYPES.keys())
            if unknown:
                raise BadFilter(
                    f"unknown event kinds {', '.join(unknown)}; "
                    f"known kinds: {', '.join(sorted(ev.EVENT_TYPES))}"
                )
        return cls(peer=last("peer"), request=last("request"), kinds=kinds)

    def accepts(self, event: ev.AnyEvent) -> bool:
        """Whether ``event`` passes every filter."""
        actor = event.actor
        if self.peer is not None and actor.peer != self.peer:
            return False
        if self.request is not None and actor.kv_request_id != self.request:
            return False
        return self.kinds is None or event.KIND in self.kinds

    def as_json(self) -> dict[str, Any]:
        """The filters as ``hello`` reports them."""
        kinds = None if self.kinds is None else sorted(self.kinds)
        return {"peer": self.peer, "request": self.request, "kinds": kinds}
