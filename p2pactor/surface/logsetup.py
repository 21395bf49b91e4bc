"""Diagnostic logging: one ``p2pactor`` logger tree, text or JSON lines on stderr.

Not to be confused with :mod:`p2pactor.runtime.log`, the *event* log of the actors.

Every module logs to ``logging.getLogger("p2pactor.<module>")`` and installs no
handler: an application that embeds p2pactor configures :mod:`logging` as it
likes and gets our lines through the root logger. The command line (and any
application that wants our format) calls :func:`configure_logging`, which puts
one handler on the ``p2pactor`` logger. Lines about a request carry ``peer`` and
``kv_request_id`` as record attributes (``extra=``, see :mod:`p2pactor.runtime.logcontext`),
so the JSON format gives them as fields a log shipper can index. docs/logging.md
has the names, the fields and examples.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
from collections.abc import Iterator
from typing import Final, Literal, TextIO, get_args

from p2pactor.errors import ConfigError
from p2pactor.runtime.logcontext import CONTEXT_FIELDS

LogFormat = Literal["text", "json"]
"""The line formats :func:`configure_logging` knows."""

ROOT: Final = "p2pactor"
"""The logger every p2pactor logger sits under."""

FORMAT_ENV: Final = "P2PACTOR_LOG_FORMAT"
"""Environment variable: the format when none is given (``text`` or ``json``)."""

LEVEL_ENV: Final = "P2PACTOR_LOG_LEVEL"
"""Environment variable: the level when none is given (``DEBUG`` .. ``CRITICAL``)."""


_FORMATS: Final[tuple[str, ...]] = get_args(LogFormat)
_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _context(record: logging.LogRecord) -> dict[str, str]:
    return {
        name: str(value)
        for name in CONTEXT_FIELDS
        if (value := getattr(record, name, None)) is not None
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers.

    Fields: ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, then
    ``node``, ``peer``, ``kv_request_id`` when the call gave them, and ``exc_info``
    (the formatted traceback) when there is one.
    """

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as one line of JSON (newlines in it are escaped)."""
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        line: dict[str, str] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_context(record),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER MESSAGE node=.. peer=.. kv_request_id=..``, for a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        """The line before any traceback, with the request's fields appended."""
        fields = [f"{name}={value}" for name, value in _context(record).items()]
        return " ".join([super().formatMessage(record), *fields])


class _Handler(logging.StreamHandler[TextIO]):
    """Our handler's own class, so a second :func:`configure_logging` finds and replaces it."""


def _named(given: str | None, env: str, default: str, names: tuple[str, ...], what: str) -> str:
    """``given``, else ``env``'s value, else ``default``: one of ``names``, in any case."""
    value = os.environ.get(env) or default if given is None else given
    for name in names:
        if name.lower() == value.strip().lower():
            return name
    flag = "--" + what.replace(" ", "-")
    raise ConfigError(f"{what} {value!r} is not one of {', '.join(names)}; fix {flag} or {env}")


def configure_logging(
    *,
    level: str | int | None = None,
    fmt: LogFormat | None = None,
    stream: TextIO | None = None,
    propagate: bool = False,
) -> logging.Logger:
    """Send the ``p2pactor`` loggers' lines to ``stream`` (stderr) as ``fmt`` from ``level`` up.

    ``level`` and ``fmt`` default to ``P2PACTOR_LOG_LEVEL`` and ``P2PACTOR_LOG_FORMAT``,
    then ``INFO`` and ``text``. Calling it again replaces the handler it installed
    (never a second copy of every line). The root logger and its handlers are left
    alone. ``propagate`` is off by default: with it on, an application that also
    configured the root logger would print every line twice. Raises
    :class:`~p2pactor.errors.ConfigError` for an unknown level or format.
    """
    logger = logging.getLogger(ROOT)
    handler = _Handler(stream)  # None: sys.stderr as it is now
    json_lines = _named(fmt, FORMAT_ENV, "text", _FORMATS, "log format") == "json"
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    logger.setLevel(
        level if isinstance(level, int) else _named(level, LEVEL_ENV, "INFO", _LEVELS, "log level")
    )
    for old in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.propagate = propagate
    return logger


def add_logging_arguments(
    parser: argparse.ArgumentParser, *, default: object = argparse.SUPPRESS
) -> None:
    """Add ``--log-format`` and ``--log-level`` to ``parser``.

    On a subcommand keep ``default`` SUPPRESS, so a value given before the
    subcommand (``p2pactor --log-format json serve``) is not overwritten by the
    subcommand's default.
    """
    parser.add_argument(
        "--log-format",
        choices=_FORMATS,
        default=default,
        help=f"diagnostic lines on stderr as text or JSON, one object a line (env {FORMAT_ENV})",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=_LEVELS,
        default=default,
        metavar="LEVEL",
        help=f"least severe level logged: {', '.join(_LEVELS)} (default INFO; env {LEVEL_ENV})",
    )


@contextlib.contextmanager
def command_logging(
    args: argparse.Namespace, *, default_level: str = "INFO"
) -> Iterator[logging.Logger]:
    """:func:`configure_logging` for one command, then the ``p2pactor`` logger as it was.

    The level is ``--log-level``, else ``P2PACTOR_LOG_LEVEL``, else ``default_level``;
    the format ``--log-format``, else ``P2PACTOR_LOG_FORMAT``, else text.
    The command line runs each command inside it, so that calling
    :func:`p2pactor.programs.cli.main` in a process that has its own logging (a test
    run, an application) changes that process's logging only while it runs.
    """
    logger = logging.getLogger(ROOT)
    level, propagate, handlers = logger.level, logger.propagate, list(logger.handlers)
    try:
        given = getattr(args, "log_level", None) or os.environ.get(LEVEL_ENV) or default_level
        yield configure_logging(level=given, fmt=getattr(args, "log_format", None))
    finally:
        logger.handlers[:] = handlers  # ours gone, the ones before as they were
        logger.setLevel(level)  # (and the level cache cleared)
        logger.propagate = propagate
