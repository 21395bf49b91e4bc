"""The fields a log line about a request carries: ``node``, ``peer``, ``kv_request_id``.

Runtime and adapters pass these dicts as ``extra=``; the formatters of
:mod:`p2pactor.surface.logsetup` print them (as JSON fields in the JSON format).
They live here, below the operator surface, so the runtime never imports it.
Also the lines an adapter begins with who says them (:func:`note`), and the
limit on how often a line that a peer can repeat at will is said (:class:`Throttle`).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Final

from p2pactor.core.ids import ActorId

# Record attributes the formatters add when a log call set them through ``extra=``.
CONTEXT_FIELDS: Final = ("node", "peer", "kv_request_id")


def request_context(
    peer: str | None, kv_request_id: str | None, *, node: str | None = None
) -> dict[str, str]:
    """The ``extra=`` of a line about one request.

    ``log.warning("...", peer, extra=request_context(peer, kv_request_id))``.
    A field given as None (not known where the line is logged) is left out.
    """
    values = (node, peer, kv_request_id)
    return {name: v for name, v in zip(CONTEXT_FIELDS, values, strict=True) if v is not None}


def actor_context(actor: ActorId, *, node: str | None = None) -> dict[str, str]:
    """The ``extra=`` of a line about one request actor: its peer and kv_request_id."""
    return request_context(actor.peer, actor.kv_request_id, node=node)


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
    peer, kv_request_id = (None, None) if match is None else match.group("peer", "kv")
    return request_context(peer, kv_request_id, node=node)


def note(
    log: logging.Logger,
    level: int,
    who: str,
    message: str,
    *args: object,
    peer: str | None = None,
    prefix: str = "",
    who_is_node: bool,
) -> None:
    """Log ``{prefix}{who}: message`` (``%``-formatted), with ``peer`` as its field.

    ``who`` is the ``node`` field too when ``who_is_node`` (a node's id, not a
    NIXL agent's name). At ``ERROR`` and above, the exception being handled
    goes with the line. An adapter binds ``log``, ``prefix`` and ``who_is_node``
    (``functools.partial``).
    """
    extra = request_context(peer, None, node=who if who_is_node else None)
    line = prefix + "%s: " + message
    log.log(level, line, who, *args, extra=extra, exc_info=level >= logging.ERROR, stacklevel=2)


class Throttle:
    """One line at most per ``interval`` seconds; those held back in between are counted.

    So that a peer's flood of the same misdeed cannot flood the log.
    """

    __slots__ = ("_held", "_interval", "_said_at")

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._said_at = -math.inf
        self._held = 0

    def due(self, now: float) -> int | None:
        """How many lines were held back since the last said, if one is due ``now``; else None.

        None counts the line held back.
        """
        if now < self._said_at + self._interval:
            self._held += 1
            return None
        held, self._held = self._held, 0
        self._said_at = now
        return held
