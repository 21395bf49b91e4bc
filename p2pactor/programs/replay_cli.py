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
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import IO, Any, Final
from urllib.parse import quote

import attrs

from p2pactor.errors import LogFormatError
from p2pactor.runtime.logread import LogHeader, LogReader
from p2pactor.surface.replay import (
    ActorResult,
    InvariantViolation,
    LogInfo,
    Replayer,
    ReplayRun,
    Summary,
    Unfinished,
    open_logs,
)

__all__ = ["DEFAULT_LIMIT", "JSON_FORMAT", "register", "run"]

DEFAULT_LIMIT: Final = 50
"""How many timelines the text output prints unless told otherwise."""

JSON_FORMAT: Final = 1
"""The version of the ``--json`` document's layout."""

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
            _write_json(sys.stdout, replay_run, readers, check=args.check)
        else:
            _write_text(sys.stdout, replay_run, readers, check=args.check)
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
                sys.stderr.write(f"{_PROG}: {level}: {_log_problem(log)}\n")
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


def _log_problem(log: LogInfo) -> str:
    assert log.problem is not None
    if log.problem.fatal:
        consequence = "events after it are lost"
    else:
        consequence = "the node stopped mid-write (expected after a crash)"
    return f"{log.path}: {log.problem}; {log.events} events read, {consequence}"


def _headers(readers: list[LogReader]) -> dict[str, LogHeader]:
    return {reader.node_id: reader.header for reader in readers}


def _wall(header: LogHeader | None, at: float) -> float | None:
    return None if header is None else header.wall_time(at)


# --- text ---------------------------------------------------------------------------


def _write_text(out: IO[str], run: ReplayRun, readers: list[LogReader], *, check: bool) -> None:
    headers = _headers(readers)
    shown = hidden = 0
    for result in run:
        if result.timeline is None:
            hidden += 1
            continue
        shown += 1
        out.writelines(_actor_lines(result, headers.get(result.node_id)))
    if hidden:
        out.write(
            f"({hidden} more {'actor' if hidden == 1 else 'actors'} not shown; "
            "use --limit N, --limit all or --request ID)\n\n"
        )
    out.writelines(_summary_lines(run.summary(), run.logs))
    if check or run.violations:
        out.writelines(_check_lines(run.violations, run.unfinished, check=check))


def _actor_lines(result: ActorResult, header: LogHeader | None) -> Iterator[str]:
    actor = result.actor
    state = result.phase if result.terminal else f"{result.phase}, log ends here"
    outcome = f": {result.outcome}" if result.outcome else ""
    wall = _wall(header, result.first_at)
    started = "" if wall is None else f", from {_format_wall(wall)}"
    yield (
        f"{result.node_id}  {actor.kv_request_id}  {actor.role.value}  {actor}  "
        f"[{state}{outcome}]  {result.events} events in {result.duration:.3f}s{started}\n"
    )
    for row in result.timeline or ():
        when = f"+{row.t:.3f}s"
        line = f"  {when:<10} {'#' + str(row.seq):<5} {row.kind:<17}  {row.detail}"
        yield line.rstrip() + "\n"
    for what in result.unfinished:
        yield f"  unfinished: {what}\n"
    if result.violations:
        yield f"  {result.violations} violations (listed below)\n"
    yield "\n"


def _format_wall(wall: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))
    return f"{stamp}.{int(wall % 1 * 1000):03d}"


def _phases(phases: dict[str, int]) -> str:
    return ", ".join(f"{phase} {count}" for phase, count in phases.items())


def _summary_lines(s: Summary, logs: list[LogInfo]) -> Iterator[str]:
    damaged = sum(1 for log in logs if log.problem is not None)
    roles = ", ".join(
        f"{role} {sum(phases.values())} ({_phases(dict(phases))})"
        for role, phases in s.phases.items()
    )
    rows = [
        ("logs", f"{len(logs)}" + (f" ({damaged} cut short, see stderr)" if damaged else "")),
        ("events", f"{s.events}"),
        ("actors", f"{s.actors}" + (f": {roles}" if roles else "")),
        ("unfinished actors", f"{s.unfinished_actors}"),
        ("lookups", f"sent {s.lookups_sent}, received {s.lookups_received}"),
        (
            "keys asked",
            f"hit {s.keys_hit}, missed {s.keys_missed}, timed out {s.keys_timed_out}",
        ),
        (
            "keys served",
            (
                f"hit {s.keys_served_hit}, missed {s.keys_served_missed}, "
                f"timed out {s.keys_served_timed_out}"
            ),
        ),
        ("fetches", f"sent {s.fetches_sent}, received {s.fetches_received}"),
        ("loads", f"done {s.loads_done}, failed {s.loads_failed}"),
        (
            "transfers",
            (
                f"started {s.transfers_started}, completed {s.transfers_completed}, "
                f"failed {s.transfers_failed}"
            ),
        ),
        ("aborts", f"sent {s.aborts_sent}, received {s.aborts_received}"),
        ("pins", f"created {s.pins_created}, released {s.pins_released}"),
        ("rejected", f"{s.rejected}"),
        (
            "quota refusals",
            ", ".join(f"{quota} {n}" for quota, n in s.quota_refusals.items()) or "0",
        ),
        ("violations", f"{s.violations}"),
    ]
    yield "summary\n"
    for name, value in rows:
        yield f"  {name:<18} {value}\n"


def _check_lines(
    violations: list[InvariantViolation], unfinished: list[Unfinished], *, check: bool
) -> Iterator[str]:
    yield "\n"
    if violations:
        # Without --check these are the log's own breaks: gaps, events after the end.
        title = "check" if check else "replay"
        yield f"{title}: {len(violations)} violations\n"
        for v in violations:
            where = f"{v.node_id}  {v.actor.kv_request_id}  #{v.seq} {v.kind}"
            yield f"  {where}: {v.message}  ({v.actor})\n"
    else:
        yield "check: no violations\n"
    if unfinished:
        yield (
            f"unfinished: {len(unfinished)} obligations still open where the logs end "
            "(the node stopped; not violations)\n"
        )
        for u in unfinished:
            yield f"  {u.node_id}  {u.actor.kv_request_id}  after #{u.seq}: {u.what}  ({u.actor})\n"


# --- JSON ---------------------------------------------------------------------------


def _actor_json(result: ActorResult, header: LogHeader | None) -> dict[str, Any]:
    actor = result.actor
    timeline = None
    if result.timeline is not None:
        timeline = [
            {"t": row.t, "seq": row.seq, "kind": row.kind, "detail": row.detail}
            for row in result.timeline
        ]
    return {
        "node_id": result.node_id,
        "actor": str(actor),
        "role": actor.role.value,
        "peer": actor.peer,
        "kv_request_id": actor.kv_request_id,
        "incarnation": actor.incarnation,
        "phase": result.phase,
        "terminal": result.terminal,
        "outcome": result.outcome,
        "events": result.events,
        "first_at": result.first_at,
        "last_at": result.last_at,
        "first_wall": _wall(header, result.first_at),
        "violations": result.violations,
        "unfinished": list(result.unfinished),
        "timeline": timeline,
    }


def _violation_json(v: InvariantViolation) -> dict[str, Any]:
    return {
        "node_id": v.node_id,
        "actor": str(v.actor),
        "role": v.actor.role.value,
        "kv_request_id": v.actor.kv_request_id,
        "seq": v.seq,
        "kind": v.kind,
        "message": v.message,
    }


def _unfinished_json(u: Unfinished) -> dict[str, Any]:
    return {
        "node_id": u.node_id,
        "actor": str(u.actor),
        "role": u.actor.role.value,
        "kv_request_id": u.actor.kv_request_id,
        "seq": u.seq,
        "what": u.what,
    }


def _log_json(log: LogInfo) -> dict[str, Any]:
    problem = None
    if log.problem is not None:
        problem = {
            "kind": log.problem.kind.value,
            "offset": log.problem.offset,
            "reason": log.problem.reason,
            "fatal": log.problem.fatal,
        }
    return {
        "path": log.path,
        "node_id": log.header.node_id,
        "created_wall": log.header.created_wall,
        "created_mono": log.header.created_mono,
        "events": log.events,
        "problem": problem,
    }


def _write_json(out: IO[str], run: ReplayRun, readers: list[LogReader], *, check: bool) -> None:
    headers = _headers(readers)
    # Written piece by piece so that the actors stream out as they end.
    out.write(f'{{"format": {JSON_FORMAT}, "check": {json.dumps(check)}, "actors": [')
    for i, result in enumerate(run):
        out.write(",\n" if i else "\n")
        out.write(json.dumps(_actor_json(result, headers.get(result.node_id))))
    warnings = [_log_problem(log) for log in run.logs if log.problem is not None]
    ok = not run.violations and not any(
        log.problem is not None and log.problem.fatal for log in run.logs
    )
    rest = {
        "logs": [_log_json(log) for log in run.logs],
        "summary": attrs.asdict(run.summary()),
        "violations": [_violation_json(v) for v in run.violations],
        "unfinished": [_unfinished_json(u) for u in run.unfinished],
        "warnings": warnings,
        "ok": ok,
    }
    out.write("\n]")
    for name, value in rest.items():
        out.write(f", {json.dumps(name)}: {json.dumps(value)}")
    out.write("}\n")
