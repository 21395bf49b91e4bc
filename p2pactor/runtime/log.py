"""The node's event log: every event of every actor, in order, in memory and on disk.

One :class:`EventLog` per node records what each actor decided, in the order the
node applied it. It keeps the last events in memory (:meth:`EventLog.recent`)
and, given a path, writes every event to a file in the format of
``docs/log-format.md``, which :func:`~p2pactor.runtime.logread.read_log` streams
back. Observers follow the node's steps, not the log (``Node.watch_events``).

How soon a record reaches the file is the :class:`Durability` policy, a trade of
append latency against how much a crash can lose (``docs/log-format.md``,
"Durability", gives measured costs).

The writer is synchronous and is called only from the node's trio thread. Only
:meth:`EventLog.flush_periodically` needs trio; the rest of the module runs
without an event loop.
"""

from __future__ import annotations

import enum
import io
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

import attrs
import msgspec
import trio

from p2pactor.core import checks
from p2pactor.core.events import AnyEvent
from p2pactor.core.ids import ActorId
from p2pactor.core.serde import encode_event
from p2pactor.errors import ConfigError, LogError
from p2pactor.runtime.logread import FORMAT_VERSION, MAGIC, MAX_RECORD_BYTES, LogHeader, frame

RING_KEYS = 131_072
"""Keys the in-memory ring's events may hold together (about 10 MB of vLLM keys)."""


class DurabilityKind(enum.Enum):
    """When appended records reach the operating system."""

    EVERY_EVENT = "every_event"
    """Each :meth:`EventLog.append` writes its records before it returns."""
    INTERVAL = "interval"
    """Records are buffered and written every ``interval_s`` by the flusher task."""
    ON_CLOSE = "on_close"
    """Records are written only by :meth:`EventLog.flush` and :meth:`EventLog.close`."""


@attrs.frozen(kw_only=True)
class Durability:
    """How soon appended events reach the file, and what a crash may lose.

    Build one with :meth:`every_event`, :meth:`interval` or :meth:`on_close`,
    or as ``Durability(kind=Durability.INTERVAL, interval_s=0.1)``.

    ``fsync=True`` also forces each write to the disk. Without it a write
    survives the process being killed (it is in the kernel's page cache) but
    not the machine losing power. With it, every write waits for the device:
    milliseconds per write on an SSD, which under EVERY_EVENT means per append
    (``docs/log-format.md``, "Durability").

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
    interval_s: float = attrs.field(default=0.05, validator=checks.positive(finite=False))
    fsync: bool = False
    max_buffer_bytes: int = attrs.field(
        default=4 * 1024 * 1024, validator=checks.positive(finite=False)
    )

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


@attrs.define(kw_only=True)
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
        appends: Calls to :meth:`EventLog.append` with at least one event.
        bytes_appended: Bytes of event records encoded by those calls (0 for a
            log kept in memory only: nothing is encoded).
        append_seconds: Time spent in those calls (``time.perf_counter``).
    """

    events_appended: int = 0
    records_written: int = 0
    bytes_written: int = 0
    records_buffered: int = 0
    bytes_buffered: int = 0  # kept by the buffer itself: filled in by the copy
    flushes: int = 0
    fsyncs: int = 0
    appends: int = 0
    bytes_appended: int = 0
    append_seconds: float = 0.0


class EventLog:
    """The ordered record of every event of one node's actors.

    Appending keeps the events in an in-memory ring and writes them to
    ``path`` (if given) as the ``durability`` policy says.

    A log always starts a new file: it refuses an existing ``path`` unless
    ``overwrite`` is true, and then truncates it. The header goes out as soon
    as the log is created, whatever the policy, so even a node killed at once
    leaves a readable (empty) log.

    Every method is synchronous and must be called from the node's trio
    thread: the log has no lock. Under the INTERVAL policy the node runs
    :meth:`flush_periodically` as a task.

    Attributes:
        node_id: The node whose events these are.
        path: The file written, or None for a log kept in memory only.
        durability: The flush policy.
        closed: Whether :meth:`close` was called.

    Args:
        node_id: The node whose events these are; recorded in the header.
        path: The file to write, or None to keep events in memory only.
        durability: When records reach the file (default: INTERVAL, 50 ms).
        keep: How many recent events :meth:`recent` keeps; None keeps every
            event (tests), 0 none. Enough to look at the last steps of a
            stuck request; a bigger ring costs the garbage collector (with
            100,000 events kept, its full collections paused a node for up
            to 0.23 s, the p99 of every lookup in flight then). Whatever
            ``keep`` says, the oldest go once the ring's events hold more
            than :data:`RING_KEYS` keys together (with ``keep=None``, never).
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
        self.node_id = node_id
        self.durability = Durability() if durability is None else durability
        self.path = None if path is None else os.fspath(path)
        self.closed = False
        self._ring: deque[tuple[AnyEvent, int]] = deque(maxlen=keep)  # events, and their keys
        self._ring_keys = 0  # the keys of every event in the ring
        self._buffer = bytearray()
        self._stats = LogStatistics()
        self._file: io.FileIO | None = None
        # What an append may leave unwritten: nothing, a bound, or everything (ON_CLOSE).
        over = {Durability.EVERY_EVENT: 0, Durability.INTERVAL: self.durability.max_buffer_bytes}
        self._write_over = over.get(self.durability.kind, math.inf)
        if path is not None:
            try:
                # Unbuffered: a write goes straight to the OS, so "written" means written.
                self._file = io.FileIO(path, "w" if overwrite else "x")
            except FileExistsError:
                raise LogError(
                    f"{self.path} already exists; an event log never appends to an old "
                    "file: choose a new path, or pass overwrite=True to replace it"
                ) from None
            except OSError as exc:
                raise LogError(
                    f"cannot create the event log {self.path}: {exc.strerror}; "
                    "check that its directory exists and is writable"
                ) from exc
            wall, mono = (time.time(), None) if clock_origin is None else clock_origin
            mono = None if mono is None else float(mono)
            header = LogHeader(
                format=FORMAT_VERSION, node_id=node_id, created_wall=float(wall), created_mono=mono
            )
            # A map in the fields' order, as the reader converts it back.
            self._buffer += MAGIC + frame(msgspec.msgpack.encode(attrs.asdict(header)))
            try:
                self._write_buffer(records=0)
            except LogError:
                self._file.close()
                raise

    def append(self, events: Sequence[AnyEvent]) -> None:
        """Record ``events`` (one actor step's, in order) after everything so far.

        Encoding happens here; the file is written only under EVERY_EVENT (one
        write for the whole batch), or when an INTERVAL buffer is over its
        limit.

        Raises:
            LogError: The log is closed, an event is over
                :data:`MAX_RECORD_BYTES`, or writing the file failed (the
                events are recorded in memory; the unwritten records stay
                buffered for the next flush).
        """
        if self.closed:
            raise LogError(f"event log of {self.node_id} is closed; nothing can be appended")
        if not events:
            return
        started = time.perf_counter()  # ~50 ns: cheap next to encoding the events
        stats = self._stats
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
                records.append(frame(payload))
            batch = b"".join(records)
            self._buffer += batch
            stats.bytes_appended += len(batch)
            stats.records_buffered += len(records)
        self._keep(events)
        stats.events_appended += len(events)
        try:
            if len(self._buffer) > self._write_over:
                self._write_buffer(records=stats.records_buffered)
        finally:
            stats.appends += 1
            stats.append_seconds += time.perf_counter() - started

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
            if self.durability.fsync:
                os.fsync(file.fileno())
                self._stats.fsyncs += 1
        except OSError as exc:
            raise LogError(
                f"writing the event log {self.path} failed: {exc.strerror}; "
                "free disk space or move the log, the unwritten records are kept"
            ) from exc
        finally:
            # Drop exactly what reached the file, so a retry never writes twice.
            del self._buffer[:written]
            stats = self._stats
            stats.bytes_written += written
            if written == total:
                stats.flushes += 1
                stats.records_written += records
                stats.records_buffered -= records

    def flush(self) -> None:
        """Write every buffered record to the file now (a no-op without a file).

        Raises:
            LogError: Writing failed; the records stay buffered.
        """
        if self._file is not None and self._buffer:
            self._write_buffer(records=self._stats.records_buffered)

    def close(self) -> None:
        """Flush and close the file; idempotent. Appending afterwards fails.

        Raises:
            LogError: The last flush failed (the file is closed anyway).
        """
        if self.closed:
            return
        self.closed = True
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
        if self.durability.kind is not DurabilityKind.INTERVAL or self._file is None:
            return
        while True:
            await trio.sleep(self.durability.interval_s)
            if self.closed:
                return
            self.flush()

    def _keep(self, events: Sequence[AnyEvent]) -> None:
        """Ring ``events``, the oldest going once the ring holds too many events or keys.

        A lookup's event holds its keys, up to 65,536: by count alone, a
        thousand of a hostile peer's largest lookups would keep gigabytes
        after their requests ended (issue 30).
        """
        ring = self._ring
        if ring.maxlen == 0:
            return
        for event in events:
            keys = getattr(event, "keys", None)
            weight = len(keys) if isinstance(keys, tuple) else 0
            if len(ring) == ring.maxlen:
                self._ring_keys -= ring[0][1]  # the deque drops its oldest
            ring.append((event, weight))
            self._ring_keys += weight
        while ring.maxlen is not None and self._ring_keys > RING_KEYS and len(ring) > 1:
            self._ring_keys -= ring.popleft()[1]

    def recent(self, actor: ActorId | None = None) -> list[AnyEvent]:
        """The events still in the in-memory ring, oldest first, of ``actor`` or all."""
        return [event for event, _ in self._ring if actor is None or event.actor == actor]

    def statistics(self) -> LogStatistics:
        """The log's counters now (a copy: the log goes on counting in its own)."""
        return attrs.evolve(self._stats, bytes_buffered=len(self._buffer))

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
