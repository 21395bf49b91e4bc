"""``p2pactor replay``: per-request timelines, a summary and invariant checks from logs.

The command streams the logs through :func:`p2pactor.surface.replay.replay_logs` and
prints each actor as soon as it has ended, so logs of millions of events are
never held whole. Text goes to stdout, warnings and errors to stderr; with
``--json`` stdout holds exactly one JSON document.

Exit status: 0 when all went well; 1 with ``--check`` when an invariant is
violated or a log is damaged before its tail (a torn tail is only a warning);
2 when the command can't run (a missing file, a file that is not a log, a
``--request`` that matches nothing); 141 when the reader of stdout went away
(``| head``), as for any command killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Final
from urllib.parse import quote

from p2pactor.errors import LogFormatError
from p2pactor.programs.replay_output import log_problem, write_json, write_text
from p2pactor.surface.replay import Replayer, ReplayRun, open_logs

DEFAULT_LIMIT: Final = 50
"""How many timelines the text output prints unless told otherwise."""

_PROG: Final = "p2pactor replay"
_SIGPIPE_STATUS: Final = 128 + 13
"""What a shell reports for a command killed by SIGPIPE; not 1, which means violations."""


def _limit(text: str) -> int | None:
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``replay`` subcommand to the ``p2pactor`` parser."""
    parser = commands.add_parser(
        "replay",
        help="rebuild requests from event logs: timelines, summary, invariant checks",
        description=(
            "Replay recorded event logs: rebuild every request's state, print its "
            "timeline and a summary, and with --check verify the protocol's invariants. "
            "Logs stream through in bounded memory, whatever their size."
        ),
    )
    parser.add_argument("logs", metavar="LOG", nargs="+", help="event log files, one per node")
    parser.add_argument(
        "--request",
        metavar="ID",
        help=(
            "replay only the actors of this kv_request_id, every role on every node "
            "(the summary and checks cover them only)"
        ),
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="verify invariants; exit 1 on a violation or a damaged log",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout instead of text"
    )
    parser.add_argument(
        "--limit",
        type=_limit,
        default=argparse.SUPPRESS,
        metavar="N",
        help=(
            f"print at most N timelines, or 'all' (default: {DEFAULT_LIMIT} in text, all with "
            "--request or --json); the summary and checks still cover every actor"
        ),
    )
    parser.add_argument(
        "--serve",
        type=int,
        metavar="PORT",
        help=(
            "serve the logs to the dashboard page on PORT (0: a free one) instead of "
            "printing, with a time slider to scrub through the run; until Ctrl-C"
        ),
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="with --serve: the address to bind (default %(default)s; anything else is exposed)",
    )
    parser.set_defaults(handler=run)


def _error(message: str) -> int:
    sys.stderr.write(f"{_PROG}: error: {message}\n")
    return 2


def run(args: argparse.Namespace) -> int:
    """Run ``p2pactor replay`` with parsed ``args``; returns the exit status."""
    try:
        readers = open_logs(args.logs)
    except FileNotFoundError as exc:
        return _error(f"{exc.filename}: no such file; pass the path of a node's event log")
    except LogFormatError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"{exc.filename}: {exc.strerror}; check the path and its permissions")
    if getattr(args, "serve", None) is not None:
        if args.check or args.json:
            return _error("--serve shows the logs in the dashboard; drop --check and --json")
        return _serve(args)
    if "limit" in args:
        limit: int | None = args.limit
    else:
        limit = None if args.json or args.request is not None else DEFAULT_LIMIT
    replayer = Replayer(check=args.check, request=args.request, timelines=limit)
    replay_run = ReplayRun(readers, replayer)
    # The command reports damaged logs itself; the reader's own warning would repeat it.
    reader_log = logging.getLogger("p2pactor.log")
    was_disabled, reader_log.disabled = reader_log.disabled, True
    try:
        if args.json:
            write_json(sys.stdout, replay_run, readers, check=args.check)
        else:
            write_text(sys.stdout, replay_run, readers, check=args.check)
    except BrokenPipeError:
        return _reader_gone()
    finally:
        reader_log.disabled = was_disabled
    logs = replay_run.logs
    damaged = [log for log in logs if log.problem is not None and log.problem.fatal]
    if not args.json:
        for log in logs:
            if log.problem is not None:
                level = "error" if log.problem.fatal else "warning"
                sys.stderr.write(f"{_PROG}: {level}: {log_problem(log)}\n")
    if args.request is not None and replay_run.summary().actors == 0:
        return _error(
            f"no actor has kv_request_id {args.request!r} in these logs; "
            "run without --request to see every request"
        )
    if args.check and (replay_run.violations or damaged):
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    """``--serve PORT``: the logs in the dashboard page until Ctrl-C or SIGTERM."""
    import signal  # noqa: PLC0415

    import trio  # noqa: PLC0415

    from p2pactor.surface.timeline import open_replay_server  # noqa: PLC0415

    if not 0 <= args.serve <= 65535:
        return _error(f"--serve {args.serve}: not a TCP port (0 picks a free one)")

    async def serve() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_replay_server(args.logs, host=args.host, port=args.serve) as server:
                url = server.url
                if args.request is not None:
                    url += f"?request={quote(args.request)}"
                sys.stdout.write(
                    f"Serving {len(args.logs)} event {'log' if len(args.logs) == 1 else 'logs'} "
                    f"to the dashboard; Ctrl-C to stop\ndashboard: {url}\n"
                )
                sys.stdout.flush()
                async for _ in signals:
                    break

    try:
        trio.run(serve)
    except OSError as exc:
        return _error(f"cannot serve on {args.host}:{args.serve}: {exc.strerror or exc}")
    except LogFormatError as exc:
        return _error(str(exc))
    return 0


def _reader_gone() -> int:
    """Stop quietly when stdout's reader (``head``, ``less``) went away, as Unix tools do."""
    # Python would flush stdout again at exit and fail again: send it nowhere.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return _SIGPIPE_STATUS
