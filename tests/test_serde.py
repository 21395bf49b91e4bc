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
from p2pactor.core.serde import Format, decode_event, decode_legacy_event, encode_event
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
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return records_of(hint)  # a record nested in an event
    return st.from_type(hint)  # type: ignore[arg-type]


def records_of(cls: type[msgspec.Struct]) -> st.SearchStrategy[msgspec.Struct]:
    hints = typing.get_type_hints(cls)
    fields = {name: strategy_for(hints[name]) for name in cls.__struct_fields__}
    return st.builds(cls, **fields)


def events_of(cls: type[ev.Event]) -> st.SearchStrategy[ev.Event]:
    return records_of(cls)  # type: ignore[return-value]


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
    assert next(iter(data)) == "kind"  # first, as in every record
    assert data["kind"] == "FetchSent@1"
    assert data["keys"] == ["AP8=", "azI="]  # base64
    assert data["actor"]["role"] == "consumer"


def record_of(event: ev.AnyEvent, fmt: Format) -> dict[str, object]:
    """The event's record as plain values (keys stay bytes in msgpack)."""
    if fmt == "json":
        return msgspec.json.decode(encode_event(event, "json"))  # type: ignore[no-any-return]
    return msgspec.msgpack.decode(encode_event(event, "msgpack"))  # type: ignore[no-any-return]


def encoded(record: dict[str, object], fmt: Format) -> bytes:
    return (msgspec.msgpack if fmt == "msgpack" else msgspec.json).encode(record)


@pytest.mark.parametrize("fmt", formats)
def test_unknown_kind_is_refused(fmt: Format) -> None:
    data = encoded({**record_of(sample(), fmt), "kind": "Teleported@1"}, fmt)
    with pytest.raises(EventFormatError, match="unknown event kind 'Teleported'"):
        decode_event(data, fmt)


@pytest.mark.parametrize("fmt", formats)
def test_newer_version_is_refused_not_guessed(fmt: Format) -> None:
    data = encoded({**record_of(sample(), fmt), "kind": "FetchSent@2"}, fmt)
    with pytest.raises(EventFormatError, match="FetchSent version 2 is not readable"):
        decode_event(data, fmt)


@pytest.mark.parametrize("fmt", formats)
def test_an_older_version_still_read_takes_the_defaults_of_fields_added_since(
    fmt: Format,
) -> None:
    """SessionLost 2 added loads_held_until: a version 1 record is read, without a hold."""
    lost = ev.SessionLost(actor=sample().actor, seq=3, at=1.5, reason="gone", loads_held_until=9.0)
    record = record_of(lost, fmt)
    del record["loads_held_until"]
    old = decode_event(encoded({**record, "kind": "SessionLost@1"}, fmt), fmt)
    assert old == msgspec.structs.replace(lost, loads_held_until=None)
    for unknown in (0, 3):
        data = encoded({**record, "kind": f"SessionLost@{unknown}"}, fmt)
        with pytest.raises(
            EventFormatError, match=f"SessionLost version {unknown} is not readable"
        ):
            decode_event(data, fmt)


@pytest.mark.parametrize("fmt", formats)
def test_mistyped_field_is_refused(fmt: Format) -> None:
    data = encoded({**record_of(sample(), fmt), "round_seq": "one"}, fmt)
    with pytest.raises(EventFormatError, match="malformed FetchSent event"):
        decode_event(data, fmt)


@pytest.mark.parametrize("fmt", formats)
@pytest.mark.parametrize("record", [[1, 2], {"kind": 5}, {"no": "kind"}, {"kind": "FetchSent"}])
def test_a_record_that_is_not_an_event_is_refused(fmt: Format, record: object) -> None:
    with pytest.raises(EventFormatError):
        decode_event(encoded(record, fmt), fmt)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", formats)
@given(junk=st.binary(max_size=64))
def test_junk_bytes_raise_only_event_format_error(fmt: Format, junk: bytes) -> None:
    with contextlib.suppress(EventFormatError):
        decode_event(junk, fmt)


# --- log format 1: each event in an envelope -------------------------------------------


def envelope(kind: str, v: int, body: dict[str, object]) -> bytes:
    return msgspec.msgpack.encode({"kind": kind, "v": v, "event": body})


def body_of(event: ev.AnyEvent) -> dict[str, object]:
    record = record_of(event, "msgpack")
    del record["kind"]
    return record


def test_a_legacy_envelope_reads_as_the_event() -> None:
    assert decode_legacy_event(envelope("FetchSent", 1, body_of(sample()))) == sample()


def test_a_legacy_envelope_of_an_older_version_takes_the_defaults() -> None:
    lost = ev.SessionLost(actor=sample().actor, seq=3, at=1.5, reason="gone", loads_held_until=9.0)
    body = body_of(lost)
    del body["loads_held_until"]
    old = decode_legacy_event(envelope("SessionLost", 1, body))
    assert old == msgspec.structs.replace(lost, loads_held_until=None)


@pytest.mark.parametrize(
    ("kind", "v", "mutate", "match"),
    [
        ("Teleported", 1, {}, "unknown event kind 'Teleported'"),
        ("FetchSent", 2, {}, "FetchSent version 2 is not readable"),
        ("FetchSent", 1, {"round_seq": "one"}, "malformed FetchSent event"),
    ],
    ids=["unknown_kind", "newer_version", "mistyped_field"],
)
def test_a_bad_legacy_envelope_is_refused(
    kind: str, v: int, mutate: dict[str, object], match: str
) -> None:
    with pytest.raises(EventFormatError, match=match):
        decode_legacy_event(envelope(kind, v, {**body_of(sample()), **mutate}))


@given(junk=st.binary(max_size=64))
def test_junk_legacy_bytes_raise_only_event_format_error(junk: bytes) -> None:
    with contextlib.suppress(EventFormatError):
        decode_legacy_event(junk)


# --- golden: the on-disk format -------------------------------------------------------
#
# One fixed instance per kind, its record in both encodings, frozen as digests.
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
    if hint is not ActorId and isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return golden_record(hint, i)  # a record nested in an event
    values: dict[object, object] = {
        ActorId: GOLDEN_ACTOR,
        bool: i % 2 == 0,
        int: 2**40 + i,
        float: i + 0.25,
        str: f"{name} #{i}",
        bytes: bytes([i, 255 - i]),
    }
    return values[hint]


def golden_record(cls: type[msgspec.Struct], first: int = 0) -> msgspec.Struct:
    hints = typing.get_type_hints(cls)
    fields = cls.__struct_fields__
    values = {name: golden_value(hints[name], first + i, name) for i, name in enumerate(fields)}
    return cls(**values)


def golden_event(cls: type[ev.Event]) -> ev.AnyEvent:
    return typing.cast("ev.AnyEvent", golden_record(cls))


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


GOLDEN: dict[str, tuple[int, str, str]] = {
    "AbortAckSent": (1, "badf21073e7d3373", "a9bb8a1c2ad83562"),
    "AbortAcked": (1, "7dafb492f700fcb0", "c9201018e8503cc7"),
    "AbortReceived": (1, "ba0ee83eab234d26", "b8b91b9a6f15c35c"),
    "AbortSent": (1, "011cd238859ef6f5", "f1afefd781eabc30"),
    "Aborted": (1, "70b35605791bec44", "87c621dc3548e709"),
    "CloseRequested": (1, "daf83919cd3b1041", "46d630376a4d33f8"),
    "Closed": (2, "0cac94703771faa1", "80054ce9d6b606f5"),
    "ContextClosed": (1, "65610666ff6a1abc", "1b614f0258ebbdac"),
    "FetchReceived": (1, "07edb7682dd509d3", "67a435d65cc90a14"),
    "FetchRefused": (1, "a5bfc710addddc42", "3b43498c1a93c5a8"),
    "FetchSent": (1, "5b9d2f0be4c66b55", "6f357ac9af8430a8"),
    "FetchSkipped": (1, "288dafdef4f1163a", "33562e4d6e9377f5"),
    "FinishRequested": (1, "414ac0c2ab01828e", "cddb1b368bac2a40"),
    "Finished": (2, "2b26288fdd9e0c46", "6538f11613277552"),
    "Ignored": (1, "a1163cd78ff72a28", "cb6b99c1df879a37"),
    "KeysPinned": (1, "51d15a2916e605d1", "d40fcd2531100eb6"),
    "KeysRefused": (1, "77437fc4a785c73a", "c8a2c16e0716b1d5"),
    "KeysResolved": (1, "aad38fec5677c5c7", "90e31c125848c07d"),
    "LookupAnswered": (2, "024041a8d5bcb920", "4ae04bfd0b8657a4"),
    "LookupCancelled": (1, "25fb9a09caeb1e0b", "75ee99a96e15b0db"),
    "LookupDropped": (1, "e0201cffc56d79aa", "d2c6f2ab815a2fbb"),
    "LookupLimited": (1, "6e59c9208d798d6a", "055e9995d539253c"),
    "LookupReceived": (1, "2d106408884f7f70", "68ddd5b171b7ccc2"),
    "LookupRefused": (1, "789f40fa6821a1ed", "4b9789fb9a5218bb"),
    "LookupResp": (1, "de3fcb34239eb38f", "d50e3fb77ec13338"),
    "LookupTimedOut": (1, "2a59b355c3a22d84", "8e22b960609e6756"),
    "Opened": (1, "416adacf2646380c", "3daec0d4270dc802"),
    "ParentExpired": (1, "2ddca140427e37e5", "57fb639be73a9d49"),
    "PendingExpired": (1, "f03887a7fcc7d16b", "6c22425bf5016443"),
    "PendingPolled": (1, "31d5a332d9f70fdf", "387fa5212cfac677"),
    "PinReleased": (1, "4ae98a80f92cd40f", "57bdc7d8a1230961"),
    "PinsRenewed": (1, "b2cee70a65c263f2", "1a76decfa91b98e2"),
    "Probed": (2, "e5235c6c9c5a6daa", "88a19a840a104756"),
    "Registered": (1, "e3ac9c3285d4acfc", "4f5594644cbd5fe3"),
    "Rejected": (1, "71d5fb7daa0b4b77", "fabc4e2cc1780993"),
    "RoundClosed": (1, "3cc6c8555b959b2f", "3900e3c3127f06cc"),
    "SessionLost": (2, "7b5a01a7fcf79209", "d8e06e3021fa28c1"),
    "StoreAdded": (1, "82f6b0068bb9f2a3", "7274867c499a5cc8"),
    "TransferCompleted": (1, "9a1fb0fff274e836", "23a3386b223d1c72"),
    "TransferDone": (1, "aefba94090f1057b", "453ed11d52b7d0ad"),
    "TransferDoneSent": (1, "c5a109a599195602", "978e543b9a233ff3"),
    "TransferFailed": (1, "1143ab07b7bafe18", "5be1967a2f81d429"),
    "TransferStarted": (1, "3370d6b7599dcdfd", "6f2aaaf68c568f7c"),
}
"""Every kind: (VERSION, msgpack digest, JSON digest) of its golden event's record."""


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


def test_a_lookup_answer_with_no_refusal_keeps_its_bytes() -> None:
    # ``refused`` (a quota's refusals, between p2pactor nodes) is optional and
    # written only when set: a record without one is byte for byte what it
    # was before the field, and readers that predate it ignore it.
    event = msgspec.structs.replace(golden_event(ev.LookupResp), refused=())
    packed, text = encode_event(event, "msgpack"), encode_event(event, "json")
    assert (digest(packed), digest(text)) == ("14dd4407af1706df", "6a69d049a63fd7ec")
    assert b"refused" not in packed
    assert decode_event(packed, "msgpack") == event


def test_a_lookup_answered_record_from_before_refused_reads_the_same() -> None:
    # LookupAnswered now writes no field at its default (so no empty
    # ``refused``); the records written before, with ``resolved`` and
    # ``pinned`` always there, decode to the same event.
    before = (
        b'{"kind":"LookupAnswered@2","actor":{"role":"producer","peer":"10.0.0.2:5710",'
        b'"kv_request_id":"req-1","incarnation":3},"seq":1099511627777,"at":2.25,'
        b'"lookup_id":1099511627779,"round_seq":1099511627780,"keys":["Bfo=","Bvk="],'
        b'"hits":[true,false],"resolved":false,"pinned":{"job_id":1099511627784,'
        b'"keys":["CfY=","CvU="],"blocks":[1099511627786,1099511627787],"expires_at":11.25}}'
    )
    assert digest(before) == "2063b623fffb6710"  # the golden JSON record of before
    event = msgspec.structs.replace(golden_event(ev.LookupAnswered), refused=())
    assert decode_event(before, "json") == event
    assert b"resolved" not in encode_event(event, "json")


def test_a_probe_of_a_named_source_keeps_its_bytes() -> None:
    # Probed gained an optional ``source`` (the automatic choice): written only
    # when set, so the records of every named-source lookup are byte for byte
    # what they were, and readers that predate it ignore the field.
    event = msgspec.structs.replace(golden_event(ev.Probed), source=None)
    packed, text = encode_event(event, "msgpack"), encode_event(event, "json")
    assert (digest(packed), digest(text)) == ("012b2a04aca8cc27", "72d43effcc580bc2")
    assert b"source" not in packed
    assert decode_event(packed, "msgpack") == event


def test_the_registry_is_exactly_the_two_roles_events() -> None:
    consumer, producer = typing.get_args(ev.ConsumerEvent), typing.get_args(ev.ProducerEvent)
    assert set(ev.EVENT_TYPES.values()) == set(consumer) | set(producer)
    assert set(typing.get_args(ev.AnyEvent)) == set(consumer) | set(producer)
    assert all(kind == cls.__name__ for kind, cls in ev.EVENT_TYPES.items())


def test_every_kind_is_exported() -> None:
    assert all(getattr(ev, kind) is cls for kind, cls in ev.EVENT_TYPES.items())


def test_a_second_event_type_of_the_same_name_is_refused() -> None:
    with pytest.raises(TypeError, match="two event types are named Closed"):

        class Closed(ev.Event, frozen=True, kw_only=True):
            reason: str

    assert ev.EVENT_TYPES["Closed"] is ev.Closed
