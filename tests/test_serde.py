"""Events round-trip through msgpack and JSON, and bad bytes fail loudly.

Every event kind is built with random field values and must decode to an equal
event in both encodings. A reader refuses an unknown kind, a schema version it
does not know, and malformed payloads with :class:`EventFormatError`.
"""

from __future__ import annotations

import contextlib
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
