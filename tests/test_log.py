"""The event log (``p2pactor.runtime.log`` and ``logread``): writing under each policy, reading.

Events are real ones: every scenario of ``tests/test_replay.py`` drives the
consumer and producer cores through the harness, and the resulting mix of event
types is what these tests write. A log must read back exactly what was
appended, whatever the policy; each policy must put records in the file when it
promises to (EVERY_EVENT before ``append`` returns, INTERVAL when trio's clock
says so, ON_CLOSE at close only). A file cut anywhere inside its last records
reads back every complete record before the cut and flags a torn tail without
raising; damage in the middle is reported as corruption at its byte offset;
files that are not logs are refused with a message that says what to do.
Whoever follows the events watches the node's steps (``Node.watch_events``): every
step's events, in the log's order, whatever a watcher does (fail, unsubscribe itself).
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import trio

from p2pactor.core import events as ev
from p2pactor.core.fold import ActorState
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.inputs import LookupResult
from p2pactor.errors import ConfigError, LogError, LogFormatError
from p2pactor.runtime.log import RING_KEYS, Durability, DurabilityKind, EventLog
from p2pactor.runtime.logread import FORMAT_VERSION, MAGIC, LogReader, ProblemKind, read_log
from p2pactor.runtime.node import Node
from tests.cluster import key, node_id, open_cluster
from tests.test_replay import NODE_B, event_mix, happy, repeated_pattern

NODE = "10.0.0.9:5710"


@pytest.fixture(scope="module")
def events() -> list[ev.AnyEvent]:
    return event_mix()


def batches(events: Sequence[ev.AnyEvent], size: int = 3) -> list[Sequence[ev.AnyEvent]]:
    return [events[i : i + size] for i in range(0, len(events), size)]


def read_all(path: Path) -> tuple[list[ev.AnyEvent], LogReader]:
    reader = read_log(path)
    return list(reader), reader


def record_offsets(path: Path) -> list[int]:
    """The byte offset of every event record, found by walking the frames by hand."""
    data = path.read_bytes()
    assert data[:8] == MAGIC
    (header_len,) = struct.unpack_from(">I", data, 8)
    offset = 8 + 8 + header_len
    offsets = []
    while offset < len(data):
        offsets.append(offset)
        (length,) = struct.unpack_from(">I", data, offset)
        offset += 8 + length
    assert offset == len(data)
    return offsets


# --- writing and reading back ---------------------------------------------------------------


@pytest.mark.parametrize(
    "durability",
    [
        Durability.every_event(),
        Durability.every_event(fsync=True),
        Durability.interval(),
        Durability.on_close(),
    ],
    ids=["every_event", "every_event_fsync", "interval", "on_close"],
)
def test_what_is_appended_reads_back_equal(
    tmp_path: Path, events: list[ev.AnyEvent], durability: Durability
) -> None:
    path = tmp_path / "node.log"
    with EventLog(NODE, path=path, durability=durability, keep=None) as log:
        for batch in batches(events):
            log.append(batch)
        assert log.recent() == events

    got, reader = read_all(path)

    assert got == events
    assert reader.problem is None
    assert not reader.torn_tail
    assert not reader.corrupt
    assert reader.events_read == len(events)
    assert reader.end_offset == path.stat().st_size
    assert reader.header.node_id == NODE


def test_every_event_writes_before_append_returns(
    tmp_path: Path, events: list[ev.AnyEvent]
) -> None:
    path = tmp_path / "node.log"
    log = EventLog(NODE, path=path, durability=Durability.every_event())
    written: list[ev.AnyEvent] = []
    for batch in batches(events, 5):
        log.append(batch)
        written.extend(batch)
        assert list(read_log(path)) == written
    stats = log.statistics()
    assert stats.records_buffered == 0
    assert stats.bytes_buffered == 0
    assert stats.flushes == len(batches(events, 5)) + 1  # one write per append, plus the header
    log.close()


def test_on_close_writes_nothing_before_close(tmp_path: Path, events: list[ev.AnyEvent]) -> None:
    path = tmp_path / "node.log"
    log = EventLog(NODE, path=path, durability=Durability.on_close())
    header_size = path.stat().st_size
    log.append(events)

    assert path.stat().st_size == header_size, "only the header is written at creation"
    assert list(read_log(path)) == []
    assert log.statistics().records_buffered == len(events)

    log.close()

    assert list(read_log(path)) == events
    assert log.statistics().records_written == len(events)


def test_flush_writes_the_buffer_under_any_policy(
    tmp_path: Path, events: list[ev.AnyEvent]
) -> None:
    path = tmp_path / "node.log"
    with EventLog(NODE, path=path, durability=Durability.on_close()) as log:
        log.append(events[:10])
        log.flush()
        assert list(read_log(path)) == events[:10]
        log.flush()  # nothing buffered: no write
        assert log.statistics().flushes == 2


async def test_interval_flusher_writes_on_trios_clock(
    tmp_path: Path, events: list[ev.AnyEvent], autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "node.log"
    log = EventLog(NODE, path=path, durability=Durability.interval(0.05))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.flush_periodically)
        start = trio.current_time()
        log.append(events[:4])
        assert list(read_log(path)) == [], "buffered until the flusher runs"

        await trio.sleep(0.06)

        assert list(read_log(path)) == events[:4]
        log.append(events[4:9])
        await trio.sleep(0.001)
        assert list(read_log(path)) == events[:4]
        await trio.sleep(0.05)
        assert list(read_log(path)) == events[:9]
        log.close()
    assert trio.current_time() - start < 0.2, "the flusher returns after close"
    assert list(read_log(path)) == events[:9]


async def test_flusher_returns_at_once_under_other_policies(tmp_path: Path) -> None:
    with trio.fail_after(1):
        await EventLog(NODE, durability=Durability.interval()).flush_periodically()
        log = EventLog(NODE, path=tmp_path / "x.log", durability=Durability.every_event())
        await log.flush_periodically()
        log.close()


def test_interval_buffer_over_its_limit_is_written_at_once(
    tmp_path: Path, events: list[ev.AnyEvent]
) -> None:
    path = tmp_path / "node.log"
    durability = Durability(kind=Durability.INTERVAL, max_buffer_bytes=2000)
    with EventLog(NODE, path=path, durability=durability) as log:
        log.append(events)
        assert log.statistics().bytes_buffered == 0
        assert list(read_log(path)) == events


def test_statistics_count_events_bytes_and_flushes(
    tmp_path: Path, events: list[ev.AnyEvent]
) -> None:
    path = tmp_path / "node.log"
    log = EventLog(NODE, path=path, durability=Durability.on_close(fsync=True))
    log.append(events[:7])
    log.append(events[7:10])
    before = log.statistics()
    log.close()
    after = log.statistics()

    assert before.events_appended == 10
    assert before.records_buffered == 10
    assert before.records_written == 0
    assert before.bytes_buffered > 0
    assert after.records_written == 10
    assert after.records_buffered == 0
    assert after.bytes_written == path.stat().st_size
    assert after.flushes == 2  # the header, then everything at close
    assert after.fsyncs == 2


def test_a_memory_only_log_keeps_a_ring_of_recent_events(events: list[ev.AnyEvent]) -> None:
    log = EventLog(NODE, keep=5)
    log.append(events[:3])
    log.append(events[3:8])

    assert log.recent() == events[3:8]
    actor = events[5].actor
    assert log.recent(actor) == [e for e in events[3:8] if e.actor == actor]
    assert log.statistics().bytes_written == 0
    assert log.path is None
    log.flush()
    log.close()


def test_keep_none_keeps_everything_and_zero_nothing(events: list[ev.AnyEvent]) -> None:
    everything = EventLog(NODE, keep=None)
    nothing = EventLog(NODE, keep=0)
    for log in (everything, nothing):
        log.append(events)
    assert everything.recent() == events
    assert nothing.recent() == []


# --- the node's event watchers: the one way to follow the events ---------------------------
# (The log tells no one: what followed its appends watches the node's steps instead.)


Watched = list[tuple[Sequence[ev.AnyEvent], ActorState]]


def stepped(watched: Watched) -> list[ev.AnyEvent]:
    return [event for events, _ in watched for event in events]


@asynccontextmanager
async def node_b() -> AsyncIterator[tuple[Node, Callable[[], list[ev.AnyEvent]]]]:
    """Node b, whose lookups of ``key(0)`` at ``A`` hit; and what b has logged since."""
    async with open_cluster("a", "b") as cluster:
        cluster["a"].store(key(0))
        b = cluster["b"]
        before = len(b.log.recent())
        yield b.node, lambda: b.log.recent()[before:]


A = node_id("a")


async def test_watchers_see_each_step_and_can_unsubscribe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with node_b() as (node, logged):
        seen: Watched = []
        unwatch = node.watch_events(lambda events, state: seen.append((events, state)))
        await node.lookup(A, "r1", [key(0)])

        assert seen
        assert stepped(seen) == logged(), "every event, in the log's order"
        for events, state in seen:
            assert state.seq == events[-1].seq, "the state after the step's events"
        unwatch()
        unwatch()
        steps = list(seen)
        await node.lookup(A, "r2", [key(0)])
        assert seen == steps


async def test_a_failing_watcher_never_breaks_a_step(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(events: Sequence[ev.AnyEvent], state: ActorState) -> None:
        raise RuntimeError("watcher bug")

    async with node_b() as (node, logged):
        seen: Watched = []
        node.watch_events(broken)
        node.watch_events(lambda events, state: seen.append((events, state)))
        with caplog.at_level(logging.ERROR, logger="p2pactor.node"):
            assert await node.lookup(A, "r1", [key(0)]) == [LookupResult.HIT]

        assert stepped(seen) == logged(), "later watchers still run"
        failures = [r for r in caplog.records if r.name == "p2pactor.node"]
        assert len(failures) == len(seen), "one line per step it failed"
        assert all("watcher" in r.getMessage() and r.exc_info for r in failures)


async def test_a_watcher_may_unsubscribe_itself_and_the_next_still_sees_that_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[int] = []

    def once(events: Sequence[ev.AnyEvent], state: ActorState) -> None:
        calls.append(len(events))
        unwatch()

    async with node_b() as (node, logged):
        after: Watched = []
        unwatch = node.watch_events(once)
        node.watch_events(lambda events, state: after.append((events, state)))
        await node.lookup(A, "r1", [key(0)])

        assert len(calls) == 1
        assert stepped(after) == logged(), "the first step too"


def test_close_is_idempotent_and_append_after_close_fails(
    tmp_path: Path, events: list[ev.AnyEvent]
) -> None:
    log = EventLog(NODE, path=tmp_path / "node.log")
    log.append(events[:2])
    log.close()
    log.close()

    assert log.closed
    with pytest.raises(LogError, match="closed"):
        log.append(events[2:3])
    assert list(read_log(tmp_path / "node.log")) == events[:2]


def test_an_existing_file_is_refused_unless_overwrite(
    tmp_path: Path, events: list[ev.AnyEvent]
) -> None:
    path = tmp_path / "node.log"
    path.write_bytes(b"precious")

    with pytest.raises(LogError, match=r"already exists.*overwrite=True"):
        EventLog(NODE, path=path)
    assert path.read_bytes() == b"precious"

    with EventLog(NODE, path=path, overwrite=True) as log:
        log.append(events[:1])
    assert list(read_log(path)) == events[:1]


def test_a_log_in_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LogError, match="directory exists"):
        EventLog(NODE, path=tmp_path / "nope" / "node.log")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_write_failure_is_a_log_error_that_says_what_to_do() -> None:
    with pytest.raises(LogError, match=r"No space left.*free disk space"):
        EventLog(NODE, path="/dev/full", overwrite=True)


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="interval_s"):
        Durability.interval(0)
    with pytest.raises(ConfigError, match="keep"):
        EventLog(NODE, keep=-1)


def test_durability_constructors() -> None:
    assert Durability().kind is Durability.INTERVAL
    assert Durability().interval_s == 0.05
    assert Durability.every_event().kind is DurabilityKind.EVERY_EVENT
    assert Durability.on_close(fsync=True).fsync
    assert Durability.interval(0.2).interval_s == 0.2


def test_header_records_the_node_and_the_clock_origin(tmp_path: Path) -> None:
    path = tmp_path / "node.log"
    EventLog(NODE, path=path, clock_origin=(1_700_000_000.0, 12.5)).close()

    header = read_log(path).header

    assert header.node_id == NODE
    assert header.format == FORMAT_VERSION == 2
    assert header.created_wall == 1_700_000_000.0
    assert header.created_mono == 12.5
    assert header.wall_time(13.0) == 1_700_000_000.5


def test_header_without_clock_origin_has_the_creation_time(tmp_path: Path) -> None:
    path = tmp_path / "node.log"
    EventLog(NODE, path=path).close()
    header = read_log(path).header
    assert header.created_wall > 1_600_000_000
    assert header.created_mono is None
    assert header.wall_time(1.0) is None


def test_a_log_bigger_than_the_read_chunk_streams_back(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    events = list(repeated_pattern(12_000))
    with EventLog(NODE_B, path=path, durability=Durability.on_close()) as log:
        log.append(events)
    assert path.stat().st_size > 2 * 1024 * 1024

    got, reader = read_all(path)

    assert got == events
    assert reader.problem is None


def test_a_reader_can_be_iterated_again(tmp_path: Path, events: list[ev.AnyEvent]) -> None:
    path = tmp_path / "node.log"
    with EventLog(NODE, path=path) as log:
        log.append(events)
    reader = read_log(path)
    assert list(reader) == list(reader) == events


# --- torn tails and corruption --------------------------------------------------------------


@pytest.fixture
def small_log(tmp_path: Path) -> tuple[Path, list[ev.AnyEvent]]:
    scenario = happy("req-1")
    events = [*scenario.consumers[0].log, *scenario.producers[0].log]
    path = tmp_path / "node.log"
    with EventLog(NODE, path=path, durability=Durability.every_event()) as log:
        log.append(events)
    return path, events


def test_a_tail_torn_anywhere_in_the_last_two_records_reads_what_is_complete(
    small_log: tuple[Path, list[ev.AnyEvent]], tmp_path: Path
) -> None:
    path, events = small_log
    data = path.read_bytes()
    offsets = record_offsets(path)
    torn = tmp_path / "torn.log"
    inside = [cut for cut in range(offsets[-2], len(data)) if cut not in offsets]
    assert len(inside) > 100
    for cut in inside:
        torn.write_bytes(data[:cut])
        complete = sum(1 for start in offsets if start < cut) - 1  # all but the one cut

        got, reader = read_all(torn)

        assert got == events[:complete], cut
        assert reader.torn_tail, cut
        assert not reader.corrupt
        assert reader.problem is not None
        assert reader.problem.kind is ProblemKind.TORN_TAIL
        assert reader.problem.offset == offsets[complete]
        assert reader.end_offset == offsets[complete]


def test_a_file_cut_at_a_record_boundary_is_simply_shorter(
    small_log: tuple[Path, list[ev.AnyEvent]], tmp_path: Path
) -> None:
    path, events = small_log
    offsets = record_offsets(path)
    cut = tmp_path / "cut.log"
    cut.write_bytes(path.read_bytes()[: offsets[-1]])

    got, reader = read_all(cut)

    assert got == events[:-1]
    assert reader.problem is None


def test_a_torn_tail_is_logged_as_a_warning(
    small_log: tuple[Path, list[ev.AnyEvent]], caplog: pytest.LogCaptureFixture
) -> None:
    path, events = small_log
    path.write_bytes(path.read_bytes()[:-1])
    with caplog.at_level(logging.WARNING, logger="p2pactor.log"):
        list(read_log(path))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "torn tail" in record.getMessage()
    assert f"stopped after {len(events) - 1} events" in record.getMessage()


def test_a_damaged_last_record_is_a_torn_tail(
    small_log: tuple[Path, list[ev.AnyEvent]],
) -> None:
    path, events = small_log
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))

    got, reader = read_all(path)

    assert got == events[:-1]
    assert reader.torn_tail
    assert reader.problem is not None
    assert "checksum" in reader.problem.reason


def test_a_zero_filled_tail_is_a_torn_tail(small_log: tuple[Path, list[ev.AnyEvent]]) -> None:
    path, events = small_log
    path.write_bytes(path.read_bytes() + bytes(4096))

    got, reader = read_all(path)

    assert got == events
    assert reader.torn_tail


@pytest.mark.parametrize("where", ["payload", "checksum"])
def test_a_flipped_byte_in_the_middle_is_corruption_at_its_record(
    small_log: tuple[Path, list[ev.AnyEvent]], where: str
) -> None:
    path, events = small_log
    offsets = record_offsets(path)
    victim = len(offsets) // 2
    data = bytearray(path.read_bytes())
    data[offsets[victim] + (20 if where == "payload" else 5)] ^= 0x40
    path.write_bytes(bytes(data))

    got, reader = read_all(path)

    assert got == events[:victim]
    assert reader.corrupt
    assert not reader.torn_tail
    assert reader.problem is not None
    assert reader.problem.kind is ProblemKind.CORRUPT
    assert reader.problem.offset == offsets[victim]
    assert f"corrupt at byte {offsets[victim]}" in str(reader.problem)


def test_an_impossible_length_in_the_middle_is_corruption(
    small_log: tuple[Path, list[ev.AnyEvent]],
) -> None:
    path, events = small_log
    offsets = record_offsets(path)
    data = bytearray(path.read_bytes())
    data[offsets[3] : offsets[3] + 4] = struct.pack(">I", 0xFFFF_FFF0)
    path.write_bytes(bytes(data))

    got, reader = read_all(path)

    assert got == events[:3]
    assert reader.corrupt
    assert reader.problem is not None
    assert "record length" in reader.problem.reason


def test_a_sound_record_with_an_unknown_event_is_unreadable(
    small_log: tuple[Path, list[ev.AnyEvent]],
) -> None:
    path, events = small_log
    payload = msgspec.msgpack.encode({"kind": "FromTheFuture@1", "seq": 1})
    with path.open("ab") as file:
        file.write(struct.pack(">II", len(payload), zlib.crc32(payload)) + payload)

    got, reader = read_all(path)

    assert got == events
    assert reader.corrupt
    assert reader.problem is not None
    assert reader.problem.kind is ProblemKind.UNREADABLE
    assert "newer p2pactor" in reader.problem.reason


# --- files that are not logs ----------------------------------------------------------------


def header_record(fields: dict[str, object]) -> bytes:
    payload = msgspec.msgpack.encode(fields)
    return struct.pack(">II", len(payload), zlib.crc32(payload)) + payload


GOOD_HEADER = {"format": 2, "node_id": NODE, "created_wall": 1.0, "created_mono": None}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is not a p2pactor event log"),
        (b"hello, world\n", "is not a p2pactor event log"),
        (
            b"P2PLOG\x00\x02" + header_record(GOOD_HEADER),
            "major format 2.*reads major format 1.*version that wrote it",
        ),
        (
            MAGIC + header_record({**GOOD_HEADER, "format": 7}),
            "log format 7.*reads formats 1, 2.*version that wrote it",
        ),
        (MAGIC + b"\x00\x00", "header is damaged"),
        (MAGIC + header_record(GOOD_HEADER)[:-2], "header is damaged"),
        (MAGIC + header_record({"format": 1, "node_id": 5}), "header is damaged"),
        (MAGIC + header_record({"node_id": NODE}), "no format number"),
    ],
    ids=[
        "empty",
        "text",
        "future-magic",
        "future-format",
        "short-header",
        "torn-header",
        "bad-fields",
        "no-format",
    ],
)
def test_files_that_are_not_readable_logs_raise_log_format_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "x.log"
    path.write_bytes(content)
    with pytest.raises(LogFormatError, match=message) as info:
        read_log(path)
    assert str(path) in str(info.value)


def test_a_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_log(tmp_path / "missing.log")


def _lookup(kv_request_id: str, keys: tuple[bytes, ...]) -> ev.LookupReceived:
    return ev.LookupReceived(
        actor=ActorId(Role.PRODUCER, "p", kv_request_id),
        seq=1,
        at=0.0,
        lookup_id=0,
        round_seq=0,
        keys=keys,
        deadline=5.0,
    )


def test_the_ring_keeps_fewer_events_when_they_hold_many_keys() -> None:
    # Issue 30: a hostile peer's largest lookups (65,536 keys each) kept by
    # count alone held hundreds of MiB after their requests ended.
    log = EventLog("n", keep=1_000)
    keys = tuple(i.to_bytes(36, "big") for i in range(65_536))
    big = [_lookup(f"r{i}", keys) for i in range(10)]
    log.append(big)
    held = log.recent()
    assert held == big[-(RING_KEYS // len(keys)) :]  # the newest that fit the bound
    assert sum(len(e.keys) for e in held) <= RING_KEYS
    small = [_lookup(f"s{i}", keys[:1]) for i in range(1_000)]
    log.append(small)
    assert log.recent() == small  # the big ones gave way; the count bound holds as before
