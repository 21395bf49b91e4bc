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

import attrs
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
    fields = {f.name: strategy_for(hints[f.name]) for f in attrs.fields(cls)}
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
    assert old == attrs.evolve(lost, loads_held_until=None)
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
    fields = attrs.fields(cls)
    values = {f.name: golden_value(hints[f.name], i, f.name) for i, f in enumerate(fields)}
    return typing.cast("ev.AnyEvent", cls(**values))


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


GOLDEN: dict[str, tuple[int, str, str]] = {
    "AbortAckSent": (1, "9a9af44b8337ca93", "8d6a1df8eeaa01db"),
    "AbortAcked": (1, "0d3a3d759b1c8829", "e57f1ce10b47dd07"),
    "AbortReceived": (1, "4d261cddd344201f", "1070f9b58aa726ba"),
    "AbortSent": (1, "f6f3786b9aa54094", "dcaea740745e73f1"),
    "Aborted": (1, "f8b9584c1bf81ed4", "c493bfe5ba17e4ac"),
    "CloseRequested": (1, "02fcae2b54ce3a95", "7b06e29bbb2f5a41"),
    "Closed": (1, "28c05dde2c86a1d5", "23f6fbc38564d8c3"),
    "ContextClosed": (1, "75c1e25e4e55f12b", "00ff58249a973564"),
    "FetchReceived": (1, "ed7a9dbbb9c85b7b", "64528904319e11a8"),
    "FetchRefused": (1, "39e6492ed19097b1", "32e40a7f7ef34b77"),
    "FetchSent": (1, "f620efde0ab39eac", "3ece6108ee6789f9"),
    "FetchSkipped": (1, "32b875c46616c32d", "324c1b3b663bc721"),
    "FinishRequested": (1, "62e14b02cd861764", "18ef23565c09621d"),
    "Finished": (1, "5f43026bbe2491d6", "59717debb7989703"),
    "Ignored": (1, "0c0f62dffd90f341", "b0b271c1fbf938a9"),
    "KeysPinned": (1, "a4252eb3dcec53cd", "5628ba26971aed02"),
    "KeysRefused": (1, "15ab0815ac19ea3a", "f720460de3947820"),
    "KeysResolved": (1, "7d296f23a96df9ab", "97f60f155078a592"),
    "LookupAnswered": (1, "3b70893ba14fe857", "734d90cbee9cd6ca"),
    "LookupCancelled": (1, "33a7083f6dd35712", "085f53c3f8c7fd88"),
    "LookupDropped": (1, "0d06382c0da7f994", "fc3ef2e783dc1ff8"),
    "LookupLimited": (1, "96f19c937bb6fc7e", "57bb5b4adb935304"),
    "LookupReceived": (1, "e51a9605a519f397", "91c1f05c848a4754"),
    "LookupRefused": (1, "83bae6eb297e3c89", "d78057b994c01f35"),
    "LookupResp": (1, "61dea3cc15064f99", "d2da8862d2aec075"),
    "LookupTimedOut": (1, "c4f20be3a6b6ffbd", "d69a63d81ed53348"),
    "Opened": (1, "e9080d90c97f9ea7", "979c19597815385a"),
    "ParentExpired": (1, "e858193e640cf294", "6db67e810819f92f"),
    "PendingExpired": (1, "6b19e2557abf3aab", "07f2e9ba6c3001ec"),
    "PendingPolled": (1, "df3f986c0f9c31cc", "ea804062dd3d7076"),
    "PinReleased": (1, "9d2bda6083fdd121", "23b89063a538dfbc"),
    "Probed": (1, "84ddaf4cca3706c6", "a334c23fe9c7ab16"),
    "Registered": (1, "150a02084bc91732", "4536a0fdcc39f1c7"),
    "Rejected": (1, "ac5aaafb0bc9cb21", "ecc44ad6145e26aa"),
    "RoundClosed": (1, "5ab24e2791096aad", "827a6a07f86e531e"),
    "SessionLost": (2, "f19b7968f83b3361", "66d3e95846476d04"),
    "StoreAdded": (1, "a1b214587f05d359", "d415f519e41f3484"),
    "TransferCompleted": (1, "92741dda31b76f50", "cc4aec0b9ec5b97a"),
    "TransferDone": (1, "a865d07221dc828a", "dfb82394be80cc9a"),
    "TransferDoneSent": (1, "db6bfe08f4f7d8f1", "1530cfa232669403"),
    "TransferFailed": (1, "53d827c20706506d", "04235f955c30789e"),
    "TransferStarted": (1, "7b5667030b35ad82", "c33e7f6bec0158bb"),
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

        @attrs.frozen(kw_only=True)
        class Closed(ev.Event):
            reason: str

    assert ev.EVENT_TYPES["Closed"] is ev.Closed
