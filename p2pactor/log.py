"""The node's event log: every event of every actor, in order, in memory and on disk.

One :class:`EventLog` per node records what each actor decided, in the order the
node applied it. It keeps the last events in memory (:meth:`EventLog.recent`),
tells listeners (the live timeline) about each batch, and, given a path, writes
every event to a file whose format is specified in ``docs/log-format.md``: a
magic number, a header record, then one self-delimiting, checksummed record per
event. :func:`read_log` streams such a file back, and stops cleanly at a torn
tail or a damaged record instead of misreading it.

How soon a record reaches the file is the :class:`Durability` policy, a trade of
append latency against how much a crash can lose; ``benchmarks/log_durability.py``
measures it.

The writer is synchronous and is called only from the node's trio thread. Only
:meth:`EventLog.flush_periodically` needs trio; the rest of the module runs
without an event loop.
"""

from __future__ import annotations

import enum
import io
import logging
import os
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, ClassVar, Final

import attrs
import msgspec
import trio

from p2pactor.core.events import AnyEvent
from p2pactor.core.ids import ActorId
from p2pactor.core.serde import decode_event, encode_event
from p2pactor.errors import ConfigError, EventFormatError, LogError, LogFormatError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "Durability",
    "DurabilityKind",
    "EventLog",
    "Listener",
    "LogHeader",
    "LogProblem",
    "LogReader",
    "LogStatistics",
    "ProblemKind",
    "read_log",
]

MAGIC: Final = b"P2PLOG\x00\x01"
"""The first eight bytes of every log file: ``P2PLOG``, then the major format, 1."""

FORMAT_VERSION: Final = 1
"""The log format this module writes and the only one it reads."""

MAX_RECORD_BYTES: Final = 128 * 1024 * 1024
"""The largest record payload a log may hold.

Above the largest event a maximum-size wire frame can produce, so a peer can't
make :meth:`EventLog.append` fail; small enough that a corrupt length can't
make the reader allocate gigabytes.
"""

_MAX_HEADER_BYTES: Final = 64 * 1024
_FRAME: Final = struct.Struct(">II")
_READ_CHUNK: Final = 1024 * 1024
_MAGIC_NAME: Final = MAGIC[:6]

logger = logging.getLogger("p2pactor.log")

Listener = Callable[[Sequence[AnyEvent]], None]
"""Called with each batch of appended events, after they are recorded."""


# --- writing ------------------------------------------------------------------------


class DurabilityKind(enum.Enum):
    """When appended records reach the operating system."""

    EVERY_EVENT = "every_event"
    """Each :meth:`EventLog.append` writes its records before it returns."""
    INTERVAL = "interval"
    """Records are buffered and written every ``interval_s`` by the flusher task."""
    ON_CLOSE = "on_close"
    """Records are written only by :meth:`EventLog.flush` and :meth:`EventLog.close`."""


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"Durability.{attribute.name} must be above 0, got {value!r}")


@attrs.frozen(kw_only=True)
class Durability:
    """How soon appended events reach the file, and what a crash may lose.

    Build one with :meth:`every_event`, :meth:`interval` or :meth:`on_close`,
    or as ``Durability(kind=Durability.INTERVAL, interval_s=0.1)``.

    ``fsync=True`` also forces each write to the disk. Without it a write
    survives the process being killed (it is in the kernel's page cache) but
    not the machine losing power. With it, every write waits for the device:
    milliseconds per write on an SSD, which under EVERY_EVENT means per append
    (see ``benchmarks/log_durability.py``).

    Attributes:
        kind: When records are written.
        interval_s: INTERVAL only: the flusher's period in seconds.
        fsync: Force each write to the disk.
        max_buffer_bytes: INTERVAL only: an append that leaves more than this
            buffered writes at once, so a stalled flusher can't grow the
            buffer without bound.
    """

    EVERY_EVENT: ClassVar[DurabilityKind] = DurabilityKind.EVERY_EVENT
    """Shorthand for :attr:`DurabilityKind.EVERY_EVENT`."""
    INTERVAL: ClassVar[DurabilityKind] = DurabilityKind.INTERVAL
    """Shorthand for :attr:`DurabilityKind.INTERVAL`."""
    ON_CLOSE: ClassVar[DurabilityKind] = DurabilityKind.ON_CLOSE
    """Shorthand for :attr:`DurabilityKind.ON_CLOSE`."""

    kind: DurabilityKind = DurabilityKind.INTERVAL
    interval_s: float = attrs.field(default=0.05, validator=_positive)
    fsync: bool = False
    max_buffer_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive)

    @classmethod
    def every_event(cls, *, fsync: bool = False) -> Durability:
        """Write each append's records before it returns: a killed node loses nothing."""
        return cls(kind=DurabilityKind.EVERY_EVENT, fsync=fsync)

    @classmethod
    def interval(cls, interval_s: float = 0.05, *, fsync: bool = False) -> Durability:
        """Write every ``interval_s``: a killed node loses at most that much."""
        return cls(kind=DurabilityKind.INTERVAL, interval_s=interval_s, fsync=fsync)

    @classmethod
    def on_close(cls, *, fsync: bool = False) -> Durability:
        """Write only at flush or close: the fastest; a killed node loses everything.

        Every record is held in memory until then; use it for tests and short runs.
        """
        return cls(kind=DurabilityKind.ON_CLOSE, fsync=fsync)


@attrs.frozen(kw_only=True)
class LogStatistics:
    """Counters of one :class:`EventLog` since it was created.

    Attributes:
        events_appended: Events passed to :meth:`EventLog.append`.
        records_written: Event records handed to the operating system.
        bytes_written: Bytes handed to the operating system, header included.
        records_buffered: Event records appended and not written yet.
        bytes_buffered: Their size in bytes.
        flushes: Writes to the operating system (one per flush with data).
        fsyncs: Writes forced to the disk.
        listener_errors: Exceptions raised by listeners (logged and swallowed).
        appends: Calls to :meth:`EventLog.append` with at least one event.
        bytes_appended: Bytes of event records encoded by those calls (0 for a
            log kept in memory only: nothing is encoded).
        append_seconds: Time spent in those calls (``time.perf_counter``).
    """

    events_appended: int
    records_written: int
    bytes_written: int
    records_buffered: int
    bytes_buffered: int
    flushes: int
    fsyncs: int
    listener_errors: int
    appends: int = 0
    bytes_appended: int = 0
    append_seconds: float = 0.0


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _header_payload(node_id: str, clock_origin: tuple[float, float] | None) -> bytes:
    wall, mono = (time.time(), None) if clock_origin is None else clock_origin
    header = {
        "format": FORMAT_VERSION,
        "node_id": node_id,
        "created_wall": float(wall),
        "created_mono": None if mono is None else float(mono),
    }
    return msgspec.msgpack.encode(header)


def _create(path: str | os.PathLike[str], *, overwrite: bool) -> io.FileIO:
    try:
        # Unbuffered: a write goes straight to the OS, so "written" means written.
        return io.FileIO(path, "w" if overwrite else "x")
    except FileExistsError:
        raise LogError(
            f"{os.fspath(path)!s} already exists; an event log never appends to an old "
            "file: choose a new path, or pass overwrite=True to replace it"
        ) from None
    except OSError as exc:
        raise LogError(
            f"cannot create the event log {os.fspath(path)!s}: {exc.strerror}; "
            "check that its directory exists and is writable"
        ) from exc


class EventLog:
    """The ordered record of every event of one node's actors.

    Appending keeps the events in an in-memory ring, writes them to ``path``
    (if given) as the ``durability`` policy says, and calls the listeners.

    A log always starts a new file: it refuses an existing ``path`` unless
    ``overwrite`` is true, and then truncates it. The header goes out as soon
    as the log is created, whatever the policy, so even a node killed at once
    leaves a readable (empty) log.

    Every method is synchronous and must be called from the node's trio
    thread: the log has no lock. Under the INTERVAL policy the node runs
    :meth:`flush_periodically` as a task.

    Args:
        node_id: The node whose events these are; recorded in the header.
        path: The file to write, or None to keep events in memory only.
        durability: When records reach the file (default: INTERVAL, 50 ms).
        keep: How many recent events :meth:`recent` keeps; None keeps every
            event (tests), 0 none. Enough to look at the last steps of a
            stuck request; a bigger ring costs the garbage collector (with
            100,000 events kept, its full collections paused a node for up
            to 0.23 s, the p99 of every lookup in flight then).
        clock_origin: ``(wall time, monotonic time)`` read at one instant,
            stored in the header so a reader can turn event times (which are
            monotonic, as trio's clock is) into wall-clock times.
        overwrite: Replace ``path`` if it exists.

    Raises:
        LogError: ``path`` exists (and ``overwrite`` is false) or can't be
            created.
        ConfigError: ``keep`` is negative.
    """

    def __init__(
        self,
        node_id: str,
        *,
        path: str | os.PathLike[str] | None = None,
        durability: Durability | None = None,
        keep: int | None = 1_000,
        clock_origin: tuple[float, float] | None = None,
        overwrite: bool = False,
    ) -> None:
        if keep is not None and keep < 0:
            raise ConfigError(f"keep must be 0 or more (or None for everything), got {keep}")
        self._node_id = node_id
        self._durability = Durability() if durability is None else durability
        self._ring: deque[AnyEvent] = deque(maxlen=keep)
        self._listeners: list[Listener] = []
        self._path = None if path is None else os.fspath(path)
        self._buffer = bytearray()
        self._records_buffered = 0
        self._closed = False
        self._events_appended = 0
        self._records_written = 0
        self._bytes_written = 0
        self._flushes = 0
        self._fsyncs = 0
        self._listener_errors = 0
        self._appends = 0
        self._bytes_appended = 0
        self._append_seconds = 0.0
        self._file: io.FileIO | None = None
        if path is not None:
            self._file = _create(path, overwrite=overwrite)
            self._buffer += MAGIC + _frame(_header_payload(node_id, clock_origin))
            try:
                self._write_buffer(records=0)
            except LogError:
                self._file.close()
                raise

    @property
    def node_id(self) -> str:
        """The node whose events these are."""
        return self._node_id

    @property
    def path(self) -> str | None:
        """The file written, or None for a log kept in memory only."""
        return self._path

    @property
    def durability(self) -> Durability:
        """The flush policy."""
        return self._durability

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def append(self, events: Sequence[AnyEvent]) -> None:
        """Record ``events`` (one actor step's, in order) after everything so far.

        Encoding happens here; the file is written only under EVERY_EVENT (one
        write for the whole batch), or when an INTERVAL buffer is over its
        limit. Listeners are called last; their exceptions are logged and
        swallowed.

        Raises:
            LogError: The log is closed, an event is over
                :data:`MAX_RECORD_BYTES`, or writing the file failed (the
                events are recorded in memory and listeners still hear of
                them; the unwritten records stay buffered for the next flush).
        """
        if self._closed:
            raise LogError(f"event log of {self._node_id} is closed; nothing can be appended")
        if not events:
            return
        started = time.perf_counter()  # ~50 ns: cheap next to encoding the events
        if self._file is not None:
            records = []
            for event in events:
                payload = encode_event(event, "msgpack")
                if len(payload) > MAX_RECORD_BYTES:
                    raise LogError(
                        f"{event.KIND} #{event.seq} of {event.actor} encodes to "
                        f"{len(payload)} bytes, over the log's {MAX_RECORD_BYTES}-byte "
                        "record limit; lower the session's max_frame_bytes"
                    )
                records.append(_frame(payload))
            batch = b"".join(records)
            self._buffer += batch
            self._bytes_appended += len(batch)
            self._records_buffered += len(records)
        self._ring.extend(events)
        self._events_appended += len(events)
        try:
            if self._buffer and self._should_write_now():
                self._write_buffer(records=self._records_buffered)
        finally:
            # The events are recorded (in memory at least): observers hear of them.
            if self._listeners:
                self._notify(events)
            self._appends += 1
            self._append_seconds += time.perf_counter() - started

    def _should_write_now(self) -> bool:
        durability = self._durability
        if durability.kind is DurabilityKind.EVERY_EVENT:
            return True
        over = len(self._buffer) > durability.max_buffer_bytes
        return over and durability.kind is DurabilityKind.INTERVAL

    def _notify(self, events: Sequence[AnyEvent]) -> None:
        # A copy: a listener may unsubscribe itself (or another) while called.
        for listener in tuple(self._listeners):
            try:
                listener(events)
            except Exception:
                # A broken observer must never stop the node from recording.
                self._listener_errors += 1
                logger.exception(
                    "event log listener %r failed; it stays subscribed (fix the listener: see "
                    "the traceback)",
                    listener,
                )

    def _write_buffer(self, *, records: int) -> None:
        file = self._file
        assert file is not None
        total = len(self._buffer)
        written = 0
        try:
            with memoryview(self._buffer) as view:
                while written < total:
                    count = file.write(view[written:])
                    # FileIO returns None only for non-blocking files; ours blocks.
                    written += count or 0
            if self._durability.fsync:
                os.fsync(file.fileno())
                self._fsyncs += 1
        except OSError as exc:
            raise LogError(
                f"writing the event log {self._path} failed: {exc.strerror}; "
                "free disk space or move the log, the unwritten records are kept"
            ) from exc
        finally:
            # Drop exactly what reached the file, so a retry never writes twice.
            del self._buffer[:written]
            self._bytes_written += written
            if written == total:
                self._flushes += 1
                self._records_written += records
                self._records_buffered -= records

    def flush(self) -> None:
        """Write every buffered record to the file now (a no-op without a file).

        Raises:
            LogError: Writing failed; the records stay buffered.
        """
        if self._file is not None and self._buffer:
            self._write_buffer(records=self._records_buffered)

    def close(self) -> None:
        """Flush and close the file; idempotent. Appending afterwards fails.

        Raises:
            LogError: The last flush failed (the file is closed anyway).
        """
        if self._closed:
            return
        self._closed = True
        self._listeners.clear()
        if self._file is None:
            return
        try:
            self.flush()
        finally:
            self._file.close()
            self._file = None

    async def flush_periodically(self) -> None:
        """Write buffered records every ``interval_s``; the INTERVAL policy's task.

        The node starts it in its nursery. It returns at once under the other
        policies or without a file, and after :meth:`close` otherwise. It
        sleeps on trio's clock, so a test's ``MockClock`` drives it.

        Raises:
            LogError: Writing failed: the node decides whether to go on
                without a durable log.
        """
        if self._durability.kind is not DurabilityKind.INTERVAL or self._file is None:
            return
        while True:
            await trio.sleep(self._durability.interval_s)
            if self._closed:
                return
            self.flush()

    def recent(self, actor: ActorId | None = None) -> list[AnyEvent]:
        """The events still in the in-memory ring, oldest first, of ``actor`` or all."""
        if actor is None:
            return list(self._ring)
        return [event for event in self._ring if event.actor == actor]

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with each appended batch; returns the unsubscribe function.

        The listener runs inside :meth:`append`, on the node's thread: it must
        be quick and must not append. Unsubscribing twice is harmless.
        """
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def statistics(self) -> LogStatistics:
        """The log's counters now."""
        return LogStatistics(
            events_appended=self._events_appended,
            records_written=self._records_written,
            bytes_written=self._bytes_written,
            records_buffered=self._records_buffered,
            bytes_buffered=len(self._buffer),
            flushes=self._flushes,
            fsyncs=self._fsyncs,
            listener_errors=self._listener_errors,
            appends=self._appends,
            bytes_appended=self._bytes_appended,
            append_seconds=self._append_seconds,
        )

    def __enter__(self) -> EventLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --- reading ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class LogHeader:
    """What a log file says about itself.

    Attributes:
        format: The log format version (1).
        node_id: The node that wrote it.
        created_wall: Wall-clock time (``time.time()``) of the clock origin.
        created_mono: The monotonic time read at the same instant, or None if
            the writer gave no clock origin (event times then stay relative).
    """

    format: int
    node_id: str
    created_wall: float
    created_mono: float | None

    def wall_time(self, at: float) -> float | None:
        """The wall-clock time of an event stamped ``at``, if the log knows it."""
        if self.created_mono is None:
            return None
        return self.created_wall + (at - self.created_mono)


class ProblemKind(enum.Enum):
    """How reading a log ended early."""

    TORN_TAIL = "torn_tail"
    """The file ends inside its last record: the writer stopped mid-write.
    Expected after a crash; every complete record before it was read."""
    CORRUPT = "corrupt"
    """A damaged record with more data after it: the file was altered."""
    UNREADABLE = "unreadable"
    """A sound record holding an event this p2pactor cannot decode."""


@attrs.frozen(kw_only=True)
class LogProblem:
    """Why reading stopped before the end of the file.

    Attributes:
        kind: Torn tail, corruption, or an unreadable event.
        offset: The byte offset of the record where reading stopped.
        reason: What was wrong, in words.
    """

    kind: ProblemKind
    offset: int
    reason: str

    @property
    def fatal(self) -> bool:
        """Whether events may be missing from the middle of the log (not just its end)."""
        return self.kind is not ProblemKind.TORN_TAIL

    def __str__(self) -> str:
        what = self.kind.value.replace("_", " ")
        return f"{what} at byte {self.offset}: {self.reason}"


class _HeaderFields(msgspec.Struct):
    node_id: str
    created_wall: float
    created_mono: float | None


def _parse_header(path: str, data: bytes) -> tuple[LogHeader, int]:
    """Check the magic and decode the header record; returns it and where data starts."""
    if data[:6] != _MAGIC_NAME:
        raise LogFormatError(
            f"{path} is not a p2pactor event log (it does not start with {_MAGIC_NAME!r}); "
            "pass a file written by p2pactor's EventLog"
        )
    if data[:8] != MAGIC:
        major = int.from_bytes(data[6:8], "big") if len(data) >= 8 else None
        raise LogFormatError(
            f"{path} is a p2pactor event log in format {major}, and this p2pactor reads "
            f"format {FORMAT_VERSION}; replay it with the p2pactor version that wrote it"
        )
    damaged = f"{path}: the log header is damaged; the file can't be replayed"
    if len(data) < 8 + _FRAME.size:
        raise LogFormatError(f"{damaged} (it ends before the header record)")
    length, crc = _FRAME.unpack_from(data, 8)
    start = 8 + _FRAME.size
    payload = data[start : start + length]
    if length > _MAX_HEADER_BYTES or len(payload) != length or zlib.crc32(payload) != crc:
        raise LogFormatError(f"{damaged} (bad header record)")
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        raise LogFormatError(f"{damaged} (the header is not msgpack)") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("format"), int):
        raise LogFormatError(f"{damaged} (the header has no format number)")
    if raw["format"] != FORMAT_VERSION:
        raise LogFormatError(
            f"{path} was written in log format {raw['format']}, and this p2pactor reads "
            f"format {FORMAT_VERSION}; replay it with the p2pactor version that wrote it"
        )
    try:
        fields = msgspec.convert(raw, _HeaderFields)
    except msgspec.ValidationError as exc:
        raise LogFormatError(f"{damaged} ({exc})") from None
    header = LogHeader(
        format=FORMAT_VERSION,
        node_id=fields.node_id,
        created_wall=fields.created_wall,
        created_mono=fields.created_mono,
    )
    return header, start + length


class LogReader:
    """A log file opened for reading: its header, then its events, streamed.

    Iterating reads the file in chunks from the first record, so a log of any
    size is read in bounded memory; each iteration starts again from the
    first record. Iteration stops early, without raising, at a torn tail, a
    damaged record or an unreadable event, logs a warning and sets
    :attr:`problem`. Build one with :func:`read_log`.

    Attributes:
        path: The file.
        header: What the file says about itself.
    """

    def __init__(self, path: str, header: LogHeader, data_offset: int) -> None:
        self.path = path
        self.header = header
        self._data_offset = data_offset
        self._problem: LogProblem | None = None
        self._events_read = 0
        self._end_offset = data_offset
        self._done = False

    @property
    def node_id(self) -> str:
        """The node that wrote the log."""
        return self.header.node_id

    @property
    def problem(self) -> LogProblem | None:
        """Why the last iteration stopped early, or None if it read the whole file."""
        return self._problem

    @property
    def torn_tail(self) -> bool:
        """The last iteration ended at a torn tail (expected after a crash)."""
        return self._problem is not None and self._problem.kind is ProblemKind.TORN_TAIL

    @property
    def corrupt(self) -> bool:
        """The last iteration stopped at corruption or an unreadable event."""
        return self._problem is not None and self._problem.fatal

    @property
    def complete(self) -> bool:
        """The last iteration ran to its end (with or without a problem)."""
        return self._done

    @property
    def events_read(self) -> int:
        """How many events the last iteration yielded."""
        return self._events_read

    @property
    def end_offset(self) -> int:
        """The byte offset just after the last complete record read."""
        return self._end_offset

    def __iter__(self) -> Iterator[AnyEvent]:
        self._reset()
        with open(self.path, "rb") as file:
            file.seek(self._data_offset)
            yield from self._records(file)
        self._done = True
        problem = self.problem
        if problem is not None:
            logger.warning("%s: %s; stopped after %d events", self.path, problem, self._events_read)

    def _reset(self) -> None:
        self._problem = None
        self._events_read = 0
        self._end_offset = self._data_offset
        self._done = False

    def _records(self, file: io.BufferedReader) -> Iterator[AnyEvent]:
        buf = b""
        pos = 0  # where the next record starts in buf
        base = self._data_offset  # the file offset of buf[0]
        eof = False

        def have(count: int) -> bool:
            """Make ``count`` bytes from ``pos`` available; False if the file is shorter."""
            nonlocal buf, pos, base, eof
            while len(buf) - pos < count and not eof:
                more = file.read(max(_READ_CHUNK, count - (len(buf) - pos)))
                if not more:
                    eof = True
                    break
                base += pos
                buf = buf[pos:] + more
                pos = 0
            return len(buf) - pos >= count

        while have(1):
            offset = base + pos
            if not have(_FRAME.size):
                self._stop(
                    ProblemKind.TORN_TAIL,
                    offset,
                    f"the file ends inside a record's frame ({len(buf) - pos} of 8 bytes)",
                )
                return
            length, crc = _FRAME.unpack_from(buf, pos)
            if length == 0 or length > MAX_RECORD_BYTES:
                if self._rest_is_zero(file, buf[pos:]):
                    self._stop(
                        ProblemKind.TORN_TAIL,
                        offset,
                        "the file ends in zero bytes the writer never filled",
                    )
                else:
                    self._stop(ProblemKind.CORRUPT, offset, f"impossible record length {length}")
                return
            if not have(_FRAME.size + length):
                got = len(buf) - pos - _FRAME.size
                self._stop(
                    ProblemKind.TORN_TAIL,
                    offset,
                    f"the file ends inside a record ({got} of {length} payload bytes)",
                )
                return
            end = pos + _FRAME.size + length  # after have(), which may move pos
            payload = buf[pos + _FRAME.size : end]
            if zlib.crc32(payload) != crc:
                pos = end
                last = not have(1)
                kind = ProblemKind.TORN_TAIL if last else ProblemKind.CORRUPT
                where = "the last record" if last else "a record with more data after it"
                self._stop(kind, offset, f"checksum mismatch in {where}")
                return
            try:
                event = decode_event(payload, "msgpack")
            except EventFormatError as exc:
                self._stop(ProblemKind.UNREADABLE, offset, str(exc))
                return
            pos = end
            self._end_offset = base + pos
            self._events_read += 1
            yield event

    @staticmethod
    def _rest_is_zero(file: io.BufferedReader, start: bytes) -> bool:
        # Filesystems may extend a file with zeros that a crash never overwrote.
        if start.strip(b"\0"):
            return False
        while chunk := file.read(_READ_CHUNK):
            if chunk.strip(b"\0"):
                return False
        return True

    def _stop(self, kind: ProblemKind, offset: int, reason: str) -> None:
        self._problem = LogProblem(kind=kind, offset=offset, reason=reason)


def read_log(path: str | os.PathLike[str]) -> LogReader:
    """Open the log at ``path``: check and read its header now, stream events later.

    Raises:
        LogFormatError: The file is not a p2pactor event log, its header is
            damaged, or it was written in a format this p2pactor can't read.
        OSError: The file can't be opened (FileNotFoundError if it is missing).
    """
    name = os.fspath(path)
    with open(name, "rb") as file:
        head = file.read(8 + _FRAME.size + _MAX_HEADER_BYTES)
    header, data_offset = _parse_header(name, head)
    return LogReader(name, header, data_offset)
