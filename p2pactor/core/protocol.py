"""The wire codec: p2pactor messages to and from msgpack frames.

The base dialect is byte-for-byte what vLLM 0.33.0's built-in P2P tier speaks
(``docs/protocol.md``): one msgpack map per frame, ``"type"`` first, then the
fields in the order vLLM writes them, keys as msgpack bin. Extensions are
optional fields that only p2pactor peers send; when a message carries none
(they are :data:`~msgspec.UNSET`), its bytes are exactly the base dialect, so a
stock vLLM peer never notices. Each extension is a feature a ``connect``
offers (``FEATURE_*``, :data:`EXTENSION`); its fields and messages
(:mod:`p2pactor.core.protocol_summaries`) go only to peers that offered it.

Each message is a frozen :class:`msgspec.Struct` whose field types carry their
bounds (:class:`msgspec.Meta`), so msgspec's own decoder checks them in C as it
builds the message: exact types (a bool is not an int, a key is bytes and
nothing else) and bounds on every list, string and number.
``__post_init__`` adds what one field's type cannot say (parallel lists, a
memory region that must fit 64 bits). Whatever the input, :func:`decode` raises
only :class:`~p2pactor.errors.ProtocolError` subclasses that name the message
type and the field (:mod:`p2pactor.core.protocol_checks` words them), because
a peer's bytes must never crash the node that reads them. Pure: no I/O, no clock.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Annotated, Final, TypeAlias

import msgspec
from msgspec import UNSET as UNSET
from msgspec import Meta
from msgspec import UnsetType as UnsetType

from p2pactor.core.protocol_checks import QUOTE_BYTES, explain, type_error
from p2pactor.core.protocol_checks import Frame as Frame
from p2pactor.core.protocol_limits import DEFAULT_LIMITS as DEFAULT_LIMITS
from p2pactor.core.protocol_limits import DEFAULT_MAX_FRAME_BYTES as DEFAULT_MAX_FRAME_BYTES
from p2pactor.core.protocol_limits import MAX_ADDRESS as MAX_ADDRESS
from p2pactor.core.protocol_limits import MAX_AGENT_METADATA_BYTES as MAX_AGENT_METADATA_BYTES
from p2pactor.core.protocol_limits import MAX_BLOCK_INDEX as MAX_BLOCK_INDEX
from p2pactor.core.protocol_limits import MAX_BLOCK_LEN as MAX_BLOCK_LEN
from p2pactor.core.protocol_limits import MAX_DEADLINE_MS as MAX_DEADLINE_MS
from p2pactor.core.protocol_limits import MAX_EXTENSION_VERSION as MAX_EXTENSION_VERSION
from p2pactor.core.protocol_limits import MAX_FEATURE_CHARS as MAX_FEATURE_CHARS
from p2pactor.core.protocol_limits import MAX_FEATURES as MAX_FEATURES
from p2pactor.core.protocol_limits import MAX_KEY_BYTES as MAX_KEY_BYTES
from p2pactor.core.protocol_limits import MAX_LIST_ITEMS as MAX_LIST_ITEMS
from p2pactor.core.protocol_limits import MAX_NUM_BLOCKS as MAX_NUM_BLOCKS
from p2pactor.core.protocol_limits import MAX_ROUND_SEQ as MAX_ROUND_SEQ
from p2pactor.core.protocol_limits import MAX_STRING_CHARS as MAX_STRING_CHARS
from p2pactor.core.protocol_limits import MAX_SUMMARY_BYTES as MAX_SUMMARY_BYTES
from p2pactor.core.protocol_limits import Limits as Limits
from p2pactor.core.protocol_limits import MessageBase, bounded, parallel, tuned_checker
from p2pactor.core.protocol_summaries import FEATURE_SUMMARIES as FEATURE_SUMMARIES
from p2pactor.core.protocol_summaries import KvsumDelta as KvsumDelta
from p2pactor.core.protocol_summaries import KvsumResync as KvsumResync
from p2pactor.core.protocol_summaries import KvsumSnapshot as KvsumSnapshot
from p2pactor.core.protocol_summaries import SummaryMessage as SummaryMessage
from p2pactor.core.protocol_summaries import fingerprints as fingerprints
from p2pactor.core.protocol_summaries import packed as packed
from p2pactor.errors import FrameTooLarge, InvalidField, MalformedFrame, ProtocolError

# Field types: the bound each has on the wire, and the Limits attribute that
# may lower it on one node (named in the Meta's ``extra``).


def in_range(least: int, most: int, limit: str) -> Meta:
    """Between ``least`` and ``most``; the ``Limits`` attribute ``limit`` lowers the top."""
    return Meta(ge=least, le=most, extra={"limit": limit})


Text = Annotated[str, bounded(MAX_STRING_CHARS, "max_string_chars")]
Key = Annotated[bytes, bounded(MAX_KEY_BYTES, "max_key_bytes")]
Keys = Annotated[tuple[Key, ...], bounded(MAX_LIST_ITEMS, "max_list_items")]
Hits = Annotated[tuple[bool, ...], bounded(MAX_LIST_ITEMS, "max_list_items")]
BlockIndex = Annotated[int, in_range(0, MAX_BLOCK_INDEX, "max_block_index")]
BlockIndexes = Annotated[tuple[BlockIndex, ...], bounded(MAX_LIST_ITEMS, "max_list_items")]
Round = Annotated[int, in_range(0, MAX_ROUND_SEQ, "max_round_seq")]
DeadlineMs = Annotated[int, in_range(0, MAX_DEADLINE_MS, "max_deadline_ms")]
Metadata = Annotated[bytes, bounded(MAX_AGENT_METADATA_BYTES, "max_agent_metadata_bytes")]
NumBlocks = Annotated[int, in_range(1, MAX_NUM_BLOCKS, "max_num_blocks")]
BlockLen = Annotated[int, in_range(1, MAX_BLOCK_LEN, "max_block_len")]
# msgpack's own integers end at 2**64 - 1: no bound to check above.
Address = Annotated[int, Meta(ge=0)]
Feature = Annotated[str, bounded(MAX_FEATURE_CHARS, "max_feature_chars")]
Features = Annotated[frozenset[Feature], bounded(MAX_FEATURES, "max_features")]
Version = Annotated[int, Meta(ge=0, le=MAX_EXTENSION_VERSION)]

FEATURE_RESP_ROUND = "lookup_resp_round"
"""A ``lookup_resp`` carries the ``round_seq`` of the lookup it answers."""
FEATURE_SESSION_ROUNDS = "session_rounds"
"""Rounds come from one counter per session, which never repeats (no ABA on a reused id)."""
FEATURE_DEADLINE = "lookup_deadline"
"""A ``lookup`` carries its ``deadline_ms``."""
FEATURE_REFUSED = "lookup_refused"
"""A ``lookup_resp`` says which of its MISSes are a quota's refusals (``refused``)."""


class PeerProcess(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Which process the sender is, on which kernel (inside a ``connect``'s extension).

    A receiver on the same kernel, in the same PID and network namespaces (the
    same ``host``), can watch that process: once it has exited, and the only
    path between the two is that kernel's, none of its writes can still land.

    Attributes:
        host: The kernel's boot id and the sender's PID and network
            namespaces, as one opaque string.
        pid: The sender's process id, in that PID namespace.
    """

    host: Text
    pid: Annotated[int, Meta(ge=1, le=2**31 - 1)]


class ConnectExtension(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The ``p2pactor`` map of a ``connect``: which extensions the sender speaks.

    A stock vLLM peer never sends it; a peer that does is a p2pactor node.
    Unknown keys inside the map are ignored, so later versions can add some.

    Attributes:
        version: The sender's extension protocol version.
        features: Names of the optional extensions the sender supports.
            Encoded as a sorted list so the bytes are deterministic.
        process: The sender's process, if it says (absent from older peers).
    """

    version: Version
    features: Features = frozenset()
    process: PeerProcess | UnsetType = UNSET

    def __post_init__(self) -> None:
        # Decoding always gives a frozenset; a caller's str would be its letters.
        if type(self.features) is not frozenset:
            raise TypeError(
                f"features must be a frozenset of str, not {type(self.features).__name__}"
            )


EXTENSION: Final = ConnectExtension(
    version=1,
    features=frozenset(
        {FEATURE_RESP_ROUND, FEATURE_SESSION_ROUNDS, FEATURE_DEADLINE, FEATURE_REFUSED}
    ),
)
"""What a p2pactor node offers in its ``connect`` (and summaries, when it shares them)."""


class Connect(MessageBase, frozen=True, kw_only=True):
    """Handshake opener, sent both ways as soon as a connection exists.

    Attributes:
        peer_id: The sender's own ``HOST:PORT`` id.
        agent_metadata: The sender's NIXL agent metadata (opaque).
        base_addr: Base address of the sender's KV block region.
        num_blocks: Number of blocks in that region.
        block_len: Size of one block, in bytes; must equal the receiver's.
        config_fingerprint: Hash of the block layout, or ``""`` if unknown.
            Compared only when both sides have one. A stock peer may omit it
            on the wire; it then decodes as ``""``.
        hash_seed: The sender's effective prefix-cache hash seed; must
            equal the receiver's.
        extension: p2pactor extensions the sender speaks, or UNSET for a
            stock vLLM peer (and then absent from the wire).
    """

    peer_id: Text
    agent_metadata: Metadata
    base_addr: Address
    num_blocks: NumBlocks
    block_len: BlockLen
    # vLLM reads the fingerprint with a default of "" and never checks it,
    # so a stock peer may legally leave it out.
    config_fingerprint: Text = ""
    hash_seed: Text
    # Under the key "p2pactor": the extensions p2pactor peers advertise.
    extension: ConnectExtension | UnsetType = msgspec.field(default=UNSET, name="p2pactor")

    def __post_init__(self) -> None:
        # The data plane computes block addresses in 64 bits; a region that
        # wraps around would alias other memory.
        end = self.base_addr + self.num_blocks * self.block_len
        if end > MAX_ADDRESS:
            raise InvalidField(
                f"is {self.base_addr}, and {self.num_blocks} blocks of {self.block_len} bytes "
                f"from there end at {end}, past the 64-bit address space",
                message_type=self.TYPE,
                field="base_addr",
            )


class ConnectAck(MessageBase, frozen=True, kw_only=True):
    """Reply to a ``connect``: the acker has registered the sender's memory.

    Attributes:
        peer_id: The acker's own ``HOST:PORT`` id.
    """

    peer_id: Text


class Disconnect(MessageBase, frozen=True, kw_only=True):
    """Graceful close, sent by either side. Carries no fields."""


class Lookup(MessageBase, frozen=True, kw_only=True):
    """Consumer to producer: which of these keys do you hold?

    Attributes:
        kv_request_id: The request the keys belong to.
        keys: Offload keys to probe, in order; duplicates allowed.
        round_seq: The lookup round these probes belong to.
        deadline_ms: Extension: the consumer's remaining lookup budget, or
            UNSET (absent from the wire, as a stock peer sends it).
    """

    kv_request_id: Text
    keys: Keys
    round_seq: Round
    deadline_ms: DeadlineMs | UnsetType = UNSET


class LookupResp(MessageBase, frozen=True, kw_only=True):
    """Producer to consumer: the answer to one ``lookup``, one bool per key.

    Attributes:
        kv_request_id: The request the lookup belonged to.
        keys: The looked-up keys, in wire order, duplicates included.
        hits: Parallel to ``keys``: True if the producer holds (and has
            pinned) the block.
        round_seq: Extension: the round of the lookup this answers, or UNSET
            (absent from the wire; stock vLLM sends no round here).
        refused: Extension (``lookup_refused``): parallel to ``keys``, True
            where the MISS is a refusal (the peer is over a quota: it says
            nothing of whether the producer holds the key), or UNSET.
    """

    kv_request_id: Text
    keys: Keys
    hits: Hits
    round_seq: Round | UnsetType = UNSET
    refused: Hits | UnsetType = UNSET

    def __post_init__(self) -> None:
        parallel(self, "hits", self.hits, self.keys)
        if self.refused is not UNSET:
            parallel(self, "refused", self.refused, self.keys)


class Fetch(MessageBase, frozen=True, kw_only=True):
    """Consumer to producer: write these blocks into mine, closing a round.

    An empty fetch (no keys, no indexes) closes the whole request instead.

    Attributes:
        kv_request_id: The request the blocks belong to.
        keys: Offload keys to transfer.
        block_indexes: Parallel to ``keys``: the consumer's block index each
            key is written into.
        round_seq: The round this fetch closes.
    """

    kv_request_id: Text
    keys: Keys
    block_indexes: BlockIndexes
    round_seq: Round

    def __post_init__(self) -> None:
        parallel(self, "block_indexes", self.block_indexes, self.keys)


class TransferDone(MessageBase, frozen=True, kw_only=True):
    """Producer to consumer: a fetch round's transfers have finished.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        success: Whether every block was written.
        round_seq: The round of the fetch.
    """

    kv_request_id: Text
    success: bool
    round_seq: Round


class AbortFetch(MessageBase, frozen=True, kw_only=True):
    """Consumer to producer: cancel a fetch round.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        round_seq: The round to cancel.
    """

    kv_request_id: Text
    round_seq: Round


class AbortAck(MessageBase, frozen=True, kw_only=True):
    """Producer to consumer: no transfer of the aborted round can still run.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        round_seq: The round that was cancelled.
    """

    kv_request_id: Text
    round_seq: Round


BaseMessage: TypeAlias = (
    Connect
    | ConnectAck
    | Disconnect
    | Lookup
    | LookupResp
    | Fetch
    | TransferDone
    | AbortFetch
    | AbortAck
)
"""A message of vLLM's base dialect (what a stock peer sends and reads)."""

Message: TypeAlias = BaseMessage | SummaryMessage
"""Any message of the protocol: the base dialect's, or an extension's."""

VLLM_MESSAGE_TYPES: Final[Mapping[str, type[BaseMessage]]] = types.MappingProxyType(
    {cls.TYPE: cls for cls in BaseMessage.__args__}
)
"""Each message class of vLLM's base dialect by its wire ``"type"``."""

MESSAGE_TYPES: Final[Mapping[str, type[Message]]] = types.MappingProxyType(
    {cls.TYPE: cls for cls in (*BaseMessage.__args__, *SummaryMessage.__args__)}
)
"""Each message class by its wire ``"type"`` string."""

# Sets (the extension's features) are written sorted, so equal messages have
# equal bytes; a struct's fields keep their order (vLLM's).
_ENCODER: Final = msgspec.msgpack.Encoder(order="deterministic")
_DECODER: Final = msgspec.msgpack.Decoder(Message)
_TUNED: Final = tuned_checker(MESSAGE_TYPES)


def encode(msg: Message) -> bytes:
    """Encode a message as one msgpack frame.

    The bytes equal what vLLM 0.33.0 sends for the same message: a map with
    ``"type"`` first and vLLM's field order, tuples as msgpack arrays, keys
    and metadata as bin. Extension fields that are UNSET are left out.

    Encoding trusts its input: field values are not checked against the
    bounds :func:`decode` enforces, since messages are built by our own code.
    """
    return _ENCODER.encode(msg)


def decode(frame: Frame, *, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode and validate one msgpack frame from a peer.

    Unknown keys in a known message are ignored, so a newer peer may add
    fields; they still count toward the frame size bound.

    Args:
        frame: The frame payload, as received (bytes, or a view of them).
        limits: The bounds to enforce (the protocol's own unless tightened).

    Returns:
        The message, with every field of the right type and within bounds.

    Raises:
        FrameTooLarge: The frame is longer than ``limits.max_frame_bytes``;
            it was not decoded at all.
        MalformedFrame: The frame is not msgpack, or not a map with a str
            ``"type"``.
        UnknownMessageType: The ``"type"`` is not one this module knows.
        InvalidField: A field is missing, of the wrong type or out of
            bounds; the error names the message type and the field.
    """
    if len(frame) > limits.max_frame_bytes:
        raise FrameTooLarge(
            f"frame is {len(frame)} bytes, more than the limit of {limits.max_frame_bytes}; "
            "it was dropped unread (raise Limits.max_frame_bytes if the peer is legitimate)"
        )
    # A long frame's type is checked before it is decoded: msgspec would
    # quote a long unknown type whole in its error.
    mtype = type_error(frame, MESSAGE_TYPES, quick=True) if len(frame) > QUOTE_BYTES else None
    if isinstance(mtype, ProtocolError):
        raise mtype
    try:
        msg: Message = _DECODER.decode(frame)
    except msgspec.ValidationError as exc:
        raise explain(frame, exc, MESSAGE_TYPES, mtype) from None
    except Exception as exc:
        # Besides DecodeError, msgspec raises RecursionError on deep nesting
        # and TypeError on a non-buffer; all of them mean "not a frame".
        raise MalformedFrame(f"not valid msgpack: {exc}") from exc
    if limits is not DEFAULT_LIMITS:
        _TUNED(msg, limits)
    return msg
