"""The p2pactor exception hierarchy.

Every error p2pactor raises on purpose derives from :class:`P2PActorError`, so an
embedding engine can catch "anything from p2pactor" in one clause. Foreign errors
(pyzmq, NIXL, msgspec) are translated at the adapter boundary into these types.

Messages say what happened *and* what to do about it, because the person reading
them is usually an operator looking at a log line, not the author of the code.
"""

from __future__ import annotations


class P2PActorError(Exception):
    """Base class of every error p2pactor raises deliberately."""


class ConfigError(P2PActorError, ValueError):
    """A configuration value is missing, out of range or inconsistent."""


class ProtocolError(P2PActorError, ValueError):
    """A peer sent something that breaks the wire protocol.

    A protocol error is the peer's fault, never ours: the session that received
    it disconnects (see PROTOCOL.md, "Abort and timeouts"), and the node keeps
    serving everyone else.

    Attributes:
        message_type: The ``"type"`` of the offending message, when known.
        field: The offending field, when the problem is one field.
        problem: What was wrong, in words.
    """

    def __init__(
        self,
        problem: str,
        *,
        message_type: str | None = None,
        field: str | None = None,
    ) -> None:
        self.problem = problem
        self.message_type = message_type
        self.field = field
        where = [] if message_type is None else [f"{message_type!r} message"]
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(f"{', '.join(where)}: {problem}" if where else problem)


class FrameTooLarge(ProtocolError):
    """A frame exceeds the configured maximum; it was rejected unread."""


class MalformedFrame(ProtocolError):
    """A frame is not a msgpack map with a string ``"type"`` key."""


class UnknownMessageType(ProtocolError):
    """A well-formed map whose ``"type"`` this protocol version does not know.

    Sessions drop such messages with a warning instead of disconnecting, as
    vLLM does, so that a newer peer can add message types.
    """


class InvalidField(ProtocolError):
    """A known message with a missing, mistyped or out-of-bounds field."""


class ReplayError(P2PActorError):
    """An event cannot be applied to a state.

    Wrong actor, wrong role, or a gap or repeat in the sequence numbers: a log
    that raises this is corrupt or was assembled from the wrong files.
    """


class EventFormatError(P2PActorError):
    """Bytes that should hold a recorded event do not.

    Not an event envelope, an unknown event kind, or a schema version this
    p2pactor cannot read.
    """


class LogError(P2PActorError):
    """The event log cannot be written as asked.

    The file already exists, cannot be created or written, or the log was
    used after :meth:`~p2pactor.runtime.log.EventLog.close`.
    """


class LogFormatError(LogError):
    """A file is not an event log this p2pactor can read.

    It does not start with the log's magic bytes, its header is damaged, or it
    was written in a newer log format. Corruption *after* a good header is not
    raised: the reader reports it and stops (see ``docs/log-format.md``).
    """


class DataPlaneError(P2PActorError):
    """The data plane (NIXL) cannot be set up as asked.

    NIXL is not installed, its agent cannot be created, or the block pool
    cannot be registered with it. The message names what to install or fix.
    """


# Every error class above, in the order they are defined; and nothing else.
__all__ = [name for name, value in list(globals().items()) if isinstance(value, type)]
