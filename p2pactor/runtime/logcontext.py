"""The fields a log line about a request carries: ``node``, ``peer``, ``kv_request_id``.

Runtime and adapters pass these dicts as ``extra=``; the formatters of
:mod:`p2pactor.surface.logsetup` print them (as JSON fields in the JSON format).
They live here, below the operator surface, so the runtime never imports it.
"""

from __future__ import annotations

import re
from typing import Final

# Record attributes the formatters add when a log call set them through ``extra=``.
CONTEXT_FIELDS: Final = ("node", "peer", "kv_request_id")


def request_context(
    peer: str | None, kv_request_id: str | None, *, node: str | None = None
) -> dict[str, str]:
    """The ``extra=`` of a line about one request.

    ``log.warning("...", peer, extra=request_context(peer, kv_request_id))``.
    A field given as None (not known where the line is logged) is left out.
    """
    fields = {"node": node, "peer": peer, "kv_request_id": kv_request_id}
    return {name: value for name, value in fields.items() if value is not None}


def peer_context(peer: str, *, node: str | None = None) -> dict[str, str]:
    """The ``extra=`` of a line about a peer but no single request."""
    return request_context(peer, None, node=node)


_PARENT_CONTEXT: Final = re.compile(r"p2p:(?P<peer>.+?:\d+):(?P<kv>.*?)(?:#\d+)?:lu\d+")


def parent_request_context(context: str, *, node: str | None = None) -> dict[str, str]:
    """The ``extra=`` of a line about a synthetic parent request named ``context``.

    The name is ``p2p:{peer}:{kv_request_id}:lu{n}`` (see
    :func:`p2pactor.core.effects.context_name`); a name of another shape gives
    no fields rather than wrong ones.
    """
    match = _PARENT_CONTEXT.fullmatch(context)
    if match is None:
        return request_context(None, None, node=node)
    return request_context(match["peer"], match["kv"], node=node)
