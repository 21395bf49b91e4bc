"""The event log's file format: its constants and framing, and a streaming reader.

The format (specified in ``docs/log-format.md``): a magic number, a header
record, then one self-delimiting, checksummed record per event, each framed
by :func:`frame` and read back by one reader, the header's as the events'.
:func:`read_log` checks the header at once and streams the events later,
stopping cleanly at a torn tail or a damaged record instead of misreading it.
:mod:`p2pactor.runtime.log` writes such files.
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from typing import BinaryIO, Final

import attrs
import msgspec

from p2pactor.core.events import AnyEvent
from p2pactor.core.serde import EVENT_DECODER, decode_event, decode_legacy_event
from p2pactor.errors import EventFormatError, LogFormatError

MAGIC: Final = b"P2PLOG\x00\x01"
"""The first eight bytes of every log file: ``P2PLOG``, then the major format, 1."""

FORMAT_VERSION: Final = 2
"""The log format p2pactor writes: 2, records that are tagged events.

It also reads format 1, whose records wrapped each event in an envelope."""

_READS: Final = {1: decode_legacy_event, 2: decode_event}

MAX_RECORD_BYTES: Final = 128 * 1024 * 1024
"""The largest record payload a log may hold.

Above the largest event a maximum-size wire frame can produce, so a peer can't
make :meth:`~p2pactor.runtime.log.EventLog.append` fail; small enough that a corrupt
length can't make the reader allocate gigabytes.
"""

_MAX_HEADER_BYTES: Final = 64 * 1024
_FRAME: Final = struct.Struct(">II")  # a record's payload length and CRC-32
_READ_CHUNK: Final = 1024 * 1024
_MAGIC_NAME: Final = MAGIC[:6]

logger = logging.getLogger("p2pactor.log")  # the writer's name: one logger for the event log


@attrs.frozen(kw_only=True)
class LogHeader:
    """What a log file says about itself.

    Attributes:
        format: The log format version (2; 1 for logs of earlier p2pactor versions).
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


def frame(payload: bytes) -> bytes:
    """``payload`` as a record: its length and CRC-32, then the payload itself."""
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def _next_record(file: BinaryIO, limit: int) -> bytes | tuple[ProblemKind, str] | None:
    """The payload of the record at ``file``'s position; or why it is not to be trusted.

    None: the file ends cleanly there.
    """
    head = file.read(_FRAME.size)
    if not head:
        return None
    if len(head) < _FRAME.size:
        reason = f"the file ends inside a record's frame ({len(head)} of 8 bytes)"
        return ProblemKind.TORN_TAIL, reason
    length, crc = _FRAME.unpack(head)
    if not 0 < length <= limit:
        # Filesystems may extend a file with zeros that a crash never overwrote.
        rest = iter(lambda: file.read(_READ_CHUNK), b"")
        if not head.strip(b"\0") and not any(chunk.strip(b"\0") for chunk in rest):
            return ProblemKind.TORN_TAIL, "the file ends in zero bytes the writer never filled"
        return ProblemKind.CORRUPT, f"impossible record length {length}"
    payload = file.read(length)
    if len(payload) < length:
        reason = f"the file ends inside a record ({len(payload)} of {length} payload bytes)"
        return ProblemKind.TORN_TAIL, reason
    if zlib.crc32(payload) == crc:
        return payload
    if file.read(1):
        return ProblemKind.CORRUPT, "checksum mismatch in a record with more data after it"
    return ProblemKind.TORN_TAIL, "checksum mismatch in the last record"


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
        problem: Why the last iteration stopped early, or None if it read the
            whole file.
        complete: The last iteration ran to its end (with or without a problem).
        events_read: How many events the last iteration yielded.
        end_offset: The byte offset just after the last complete record read.
    """

    def __init__(self, path: str, header: LogHeader, data_offset: int) -> None:
        self.path = path
        self.header = header
        self._data_offset = data_offset
        self._reset()

    def _reset(self) -> None:
        self.problem: LogProblem | None = None
        self.complete = False
        self.events_read = 0
        self.end_offset = self._data_offset

    @property
    def node_id(self) -> str:
        """The node that wrote the log."""
        return self.header.node_id

    @property
    def torn_tail(self) -> bool:
        """The last iteration ended at a torn tail (expected after a crash)."""
        return self.problem is not None and self.problem.kind is ProblemKind.TORN_TAIL

    @property
    def corrupt(self) -> bool:
        """The last iteration stopped at corruption or an unreadable event."""
        return self.problem is not None and self.problem.fatal

    def __iter__(self) -> Iterator[AnyEvent]:
        self._reset()
        decode = _READS[self.header.format]
        # This version's records: msgspec's decoder of the union, called bare.
        fast = EVENT_DECODER.decode if decode is decode_event else decode
        with open(self.path, "rb", buffering=_READ_CHUNK) as file:
            file.seek(self._data_offset)
            while isinstance(payload := _next_record(file, MAX_RECORD_BYTES), bytes):
                try:
                    event = fast(payload)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    try:  # another version of a kind, or not an event: the full rules
                        event = decode(payload)
                    except EventFormatError as exc:
                        payload = (ProblemKind.UNREADABLE, str(exc))
                        break
                self.end_offset += _FRAME.size + len(payload)
                self.events_read += 1
                yield event
        self.complete = True
        if payload is not None:
            # Records follow each other: the one that stopped us starts where the last ended.
            self.problem = LogProblem(kind=payload[0], offset=self.end_offset, reason=payload[1])
            logger.warning(
                "%s: %s; stopped after %d events", self.path, self.problem, self.events_read
            )


def read_log(path: str | os.PathLike[str]) -> LogReader:
    """Open the log at ``path``: check and read its header now, stream events later.

    Raises:
        LogFormatError: The file is not a p2pactor event log, its header is
            damaged, or it was written in a format this p2pactor can't read.
        OSError: The file can't be opened (FileNotFoundError if it is missing).
    """
    path = os.fspath(path)
    with open(path, "rb") as file:
        magic = file.read(len(MAGIC))
        if magic[:6] != _MAGIC_NAME:
            raise LogFormatError(
                f"{path} is not a p2pactor event log (it does not start with {_MAGIC_NAME!r}); "
                "pass a file written by p2pactor's EventLog"
            )
        if magic != MAGIC:
            major = int.from_bytes(magic[6:8], "big") if len(magic) == 8 else None
            raise LogFormatError(
                f"{path} is a p2pactor event log in major format {major}, and this p2pactor "
                "reads major format 1; replay it with the p2pactor version that wrote it"
            )
        damaged = f"{path}: the log header is damaged; the file can't be replayed"
        payload = _next_record(file, _MAX_HEADER_BYTES)
        if not isinstance(payload, bytes):
            raise LogFormatError(f"{damaged} ({'no header' if payload is None else payload[1]})")
        try:
            raw = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            raise LogFormatError(f"{damaged} (the header is not msgpack)") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("format"), int):
            raise LogFormatError(f"{damaged} (the header has no format number)")
        if raw["format"] not in _READS:
            raise LogFormatError(
                f"{path} was written in log format {raw['format']}, and this p2pactor reads "
                f"formats {', '.join(map(str, _READS))}; replay it with the p2pactor version "
                "that wrote it"
            )
        try:
            header = msgspec.convert(raw, LogHeader)
        except msgspec.ValidationError as exc:
            raise LogFormatError(f"{damaged} ({exc})") from None
        return LogReader(path, header, file.tell())
