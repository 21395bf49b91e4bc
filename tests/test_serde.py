"""Events round-trip through msgpack and JSON, and bad bytes fail loudly.

Every event kind is built with random field values and must decode to an equal
event in both encodings. A reader refuses an unknown kind, a schema version it
does not know, and malformed payloads with :class:`EventFormatError`.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import types
import typing

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given

from p2pactor.core import events as ev
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.serde import Format, decode_event, encode_event
from p2pactor.errors import EventFormatError

actors = st.builds(
    ActorId,
    role=st.sampled_from(Role),
    peer=st.text(max_size=30),
    kv_request_id=st.text(max_size=30),
    incarnation=st.integers(0, 10),
)
finite = st.floats(allow_nan=False, allow_infinity=False)


def strategy_for(hint: object) -> st.SearchStrategy[object]:
    """A strategy for a field type, with floats that compare equal to themselves."""
    if hint is float:
        return finite
    if hint is int:  # every integer we record fits msgpack's 64 bits
        return st.integers(-(2**63), 2**64 - 1)
    if hint is ActorId:
        return actors
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType):
        return st.one_of([strategy_for(a) for a in args])
    if typing.get_origin(hint) is tuple:
        return st.lists(strategy_for(args[0]), max_size=5).map(tuple)
    return st.from_type(hint)  # type: ignore[arg-type]


def events_of(cls: type[ev.Event]) -> st.SearchStrategy[ev.Event]:
    hints = typing.get_type_hints(cls)
    fields = {name: strategy_for(hints[name]) for name in cls.__struct_fields__}
    return st.builds(cls, **fields)


any_event = st.one_of([events_of(cls) for cls in ev.EVENT_TYPES.values()])
formats: list[Format] = ["msgpack", "json"]


@pytest.mark.parametrize("fmt", formats)
@given(event=any_event)
def test_every_event_round_trips(fmt: Format, event: ev.AnyEvent) -> None:
    assert decode_event(encode_event(event, fmt), fmt) == event


@pytest.mark.parametrize("kind", sorted(ev.EVENT_TYPES))
def test_every_kind_is_registered_under_its_name(kind: str) -> None:
    assert kind == ev.EVENT_TYPES[kind].KIND


def sample() -> ev.FetchSent:
    return ev.FetchSent(
        actor=ActorId(Role.CONSUMER, "10.0.0.2:5710", "req-1"),
        seq=4,
        at=12.5,
        round_seq=1,
        job_id=7,
        keys=(b"\x00\xff", b"k2"),
        block_indexes=(3, 4),
        load_deadline=42.5,
        next_round=2,
    )


def test_json_form_is_readable() -> None:
    data = msgspec.json.decode(encode_event(sample(), "json"))
    assert data["kind"] == "FetchSent"
    assert data["v"] == 1
    assert data["event"]["keys"] == ["AP8=", "azI="]  # base64
    assert data["event"]["actor"]["role"] == "consumer"


@pytest.mark.parametrize("fmt", formats)
def test_unknown_kind_is_refused(fmt: Format) -> None:
    enc = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    data = enc.encode({"kind": "Teleported", "v": 1, "event": {}})
    with pytest.raises(EventFormatError, match="unknown event kind 'Teleported'"):
        decode_event(data, fmt)


@pytest.mark.parametrize("fmt", formats)
def test_newer_version_is_refused_not_guessed(fmt: Format) -> None:
    enc = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    body = msgspec.msgpack.decode(encode_event(sample(), "msgpack"))["event"]
    if fmt == "json":
        body = msgspec.json.decode(encode_event(sample(), "json"))["event"]
    data = enc.encode({"kind": "FetchSent", "v": 2, "event": body})
    with pytest.raises(EventFormatError, match="FetchSent version 2 is not readable"):
        decode_event(data, fmt)


@pytest.mark.parametrize("fmt", formats)
def test_an_older_version_still_read_takes_the_defaults_of_fields_added_since(
    fmt: Format,
) -> None:
    """SessionLost 2 added loads_held_until: a version 1 record is read, without a hold."""
    enc = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    lost = ev.SessionLost(actor=sample().actor, seq=3, at=1.5, reason="gone", loads_held_until=9.0)
    body = msgspec.json.decode(encode_event(lost, "json"))["event"]
    del body["loads_held_until"]
    old = decode_event(enc.encode({"kind": "SessionLost", "v": 1, "event": body}), fmt)
    assert old == msgspec.structs.replace(lost, loads_held_until=None)
    for unknown in (0, 3):
        data = enc.encode({"kind": "SessionLost", "v": unknown, "event": body})
        with pytest.raises(
            EventFormatError, match=f"SessionLost version {unknown} is not readable"
        ):
            decode_event(data, fmt)


@pytest.mark.parametrize("fmt", formats)
def test_mistyped_field_is_refused(fmt: Format) -> None:
    enc = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    body = msgspec.json.decode(encode_event(sample(), "json"))["event"]
    body["round_seq"] = "one"
    if fmt == "msgpack":
        body["keys"] = [b"\x00\xff", b"k2"]
    data = enc.encode({"kind": "FetchSent", "v": 1, "event": body})
    with pytest.raises(EventFormatError, match="malformed FetchSent event"):
        decode_event(data, fmt)


@pytest.mark.parametrize("fmt", formats)
@given(junk=st.binary(max_size=64))
def test_junk_bytes_raise_only_event_format_error(fmt: Format, junk: bytes) -> None:
    with contextlib.suppress(EventFormatError):
        decode_event(junk, fmt)


# --- golden: the on-disk format -------------------------------------------------------
#
# One fixed instance per kind, its envelope in both encodings, frozen as digests.
# A change here changes what every existing log decodes to: bump the kind's
# VERSION instead, and only then update the table.

GOLDEN_ACTOR = ActorId(Role.PRODUCER, "10.0.0.2:5710", "req-1", incarnation=3)


def golden_value(hint: object, i: int, name: str) -> object:
    """A fixed value for field number ``i`` (named ``name``) of type ``hint``."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType):  # X | None: the X
        return golden_value(next(a for a in args if a is not type(None)), i, name)
    if typing.get_origin(hint) is tuple:
        return tuple(golden_value(args[0], i + j, name) for j in range(2))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        members = list(hint)
        return members[i % len(members)]
    values: dict[object, object] = {
        ActorId: GOLDEN_ACTOR,
        bool: i % 2 == 0,
        int: 2**40 + i,
        float: i + 0.25,
        str: f"{name} #{i}",
        bytes: bytes([i, 255 - i]),
    }
    return values[hint]


def golden_event(cls: type[ev.Event]) -> ev.AnyEvent:
    hints = typing.get_type_hints(cls)
    fields = cls.__struct_fields__
    values = {name: golden_value(hints[name], i, name) for i, name in enumerate(fields)}
    return typing.cast("ev.AnyEvent", cls(**values))


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


GOLDEN: dict[str, tuple[int, str, str]] = {
    "AbortAckSent": (1, "fc9b3533bb226d54", "ed0bc35f1961ae85"),
    "AbortAcked": (1, "34fe89b14b5e7525", "787e10e368b53365"),
    "AbortReceived": (1, "67c2e7fbe8da8b40", "2c0857c7cfbf004b"),
    "AbortSent": (1, "7822aad0a13c5781", "7998f9453c3cbb7c"),
    "Aborted": (1, "ccca9a9071cc0328", "2ba0d34223988a3d"),
    "CloseRequested": (1, "8abf92ecc70f4982", "c56d0f8511ba2d6a"),
    "Closed": (1, "f60b2f9180cbc4d6", "f1409e37e2560faf"),
    "ContextClosed": (1, "6603045bb8538d81", "a8e40af34aabdd6c"),
    "FetchReceived": (1, "a375db8d3c92025a", "b3e2dbbcdc2adb60"),
    "FetchRefused": (1, "344d900078046480", "ced4f1554bb725a4"),
    "FetchSent": (1, "b4546af76ef025a6", "9b231901f080323f"),
    "FetchSkipped": (1, "d5cb95016e847dc4", "6f97b3366de72ab7"),
    "FinishRequested": (1, "77a18f03487c71c8", "3095f66648e3b605"),
    "Finished": (1, "60139abcd2438d92", "3c517cfef6ce08e2"),
    "Ignored": (1, "a4a7a9f2f9c75fb0", "23c84aa593d199e1"),
    "KeysPinned": (1, "837f79eee6dd58b4", "391bdbde2bd68a70"),
    "KeysRefused": (1, "d19bd82ffa56e19b", "af1d1d163aa370f4"),
    "KeysResolved": (1, "5ae2aae1150943c5", "fa3db6b0c5b29bfd"),
    "LookupAnswered": (1, "3d5a7c95f9ac883e", "8f4c2d8bb8dea302"),
    "LookupCancelled": (1, "921fd34d7e4b91c2", "4201919cecb5af34"),
    "LookupDropped": (1, "e5a9732b0887331f", "491da33283e2a596"),
    "LookupLimited": (1, "ee08e513c52a2af5", "f7a2f86a02933a65"),
    "LookupReceived": (1, "71f2a9a0cc8c7a13", "cd83c307a985c018"),
    "LookupRefused": (1, "a1cabeb17e945c3f", "4958429f46fcad97"),
    "LookupResp": (1, "ce4f989cd5b3c776", "0c63f69191270307"),
    "LookupTimedOut": (1, "8d82d2de9010e7ce", "0cff9eea4c3e71fa"),
    "Opened": (1, "bf38759c43b5697d", "f4565ad68745d9f0"),
    "ParentExpired": (1, "6172fa52d8be7c4a", "d04cae28bec0b783"),
    "PendingExpired": (1, "6ba7b9f1f0399045", "8119552bad0a9066"),
    "PendingPolled": (1, "b756b8aa13f879f3", "159130360f1d5d13"),
    "PinReleased": (1, "5fe6c8e991d63ffc", "83a96d6d5f0c73ff"),
    "Probed": (1, "9dc5c906f6c03788", "f532c13f7750f1d4"),
    "Registered": (1, "b99591c2c5d05d6c", "ae446cd9d38720d8"),
    "Rejected": (1, "4e8adae83497aae3", "78dde93e87dd67c7"),
    "RoundClosed": (1, "fcdc9198b074147a", "56eed7246d2aa7f2"),
    "SessionLost": (2, "9de1e2ac371cbd02", "5ff7b74f98983bc0"),
    "StoreAdded": (1, "d53e2eb6fb57107a", "731e4ecc8a2b9477"),
    "TransferCompleted": (1, "acc69e61a826ce25", "57367a4904f39de5"),
    "TransferDone": (1, "412f44a43ddda07c", "51d40b544b655913"),
    "TransferDoneSent": (1, "77960f2158989af6", "e6a0cde567dc5039"),
    "TransferFailed": (1, "0a11d5a3ffad5ebe", "77e7350b558d7523"),
    "TransferStarted": (1, "cbf33ec976eb7405", "8bdc9da6062aa0a3"),
}
"""Every kind: (VERSION, msgpack digest, JSON digest) of its golden event's envelope."""


def test_the_kinds_and_their_versions_are_frozen() -> None:
    assert sorted((k, c.VERSION) for k, c in ev.EVENT_TYPES.items()) == [
        (k, v) for k, (v, _, _) in sorted(GOLDEN.items())
    ]


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_the_bytes_of_each_kind_are_frozen(kind: str) -> None:
    event = golden_event(ev.EVENT_TYPES[kind])
    packed, text = encode_event(event, "msgpack"), encode_event(event, "json")
    assert (digest(packed), digest(text)) == GOLDEN[kind][1:], text.decode()
    assert decode_event(packed, "msgpack") == event == decode_event(text, "json")


def test_the_registry_is_exactly_the_two_roles_events() -> None:
    consumer, producer = typing.get_args(ev.ConsumerEvent), typing.get_args(ev.ProducerEvent)
    assert set(ev.EVENT_TYPES.values()) == set(consumer) | set(producer)
    assert set(typing.get_args(ev.AnyEvent)) == set(consumer) | set(producer)
    assert all(kind == cls.__name__ for kind, cls in ev.EVENT_TYPES.items())


def test_every_kind_is_exported() -> None:
    assert set(ev.EVENT_TYPES) <= set(ev.__all__)
    assert all(getattr(ev, name) is not None for name in ev.__all__)


def test_a_second_event_type_of_the_same_name_is_refused() -> None:
    with pytest.raises(TypeError, match="two event types are named Closed"):

        class Closed(ev.Event, frozen=True, kw_only=True):
            reason: str

    assert ev.EVENT_TYPES["Closed"] is ev.Closed
