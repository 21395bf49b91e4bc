"""Who an actor is: its role, its peer and its kv_request_id."""

from __future__ import annotations

import enum

import msgspec


class IdentityEnum(enum.Enum):
    """An enum whose members hash by identity, in C.

    Members are singletons compared by identity anyway; :class:`enum.Enum`'s own
    ``__hash__`` is Python code, and the core hashes its enums on every event
    (actor tables keyed by :class:`ActorId`, phase tables, terminal sets).
    """

    __hash__ = object.__hash__


class Role(IdentityEnum):
    """Which side of a request an actor plays.

    Attributes:
        CONSUMER: Our request, pulling blocks from a peer.
        PRODUCER: A peer's request, served from our blocks.
    """

    CONSUMER = "consumer"
    PRODUCER = "producer"


class ActorId(msgspec.Struct, frozen=True, gc=False, cache_hash=True):
    """The identity of one request actor.

    One actor exists per (peer, kv_request_id, role). A kv_request_id that a
    peer reuses after its actor has ended gets a new ``incarnation``, so two
    lives of the same id never share an event stream.

    Attributes:
        role: Consumer (our request) or producer (a peer's request we serve).
        peer: The peer's id, ``"host:port"`` exactly as it bound its socket.
        kv_request_id: The request id both peers use on the wire.
        incarnation: 0 for the first actor with this id on this peer, then 1, 2...
    """

    role: Role
    peer: str
    kv_request_id: str
    incarnation: int = 0

    def __str__(self) -> str:
        tag = "c" if self.role is Role.CONSUMER else "p"
        suffix = f"#{self.incarnation}" if self.incarnation else ""
        return f"{tag}:{self.peer}:{self.kv_request_id}{suffix}"
