"""``p2pactor replay``'s output: the text report and the ``--json`` document."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import IO, Any

import attrs

from p2pactor.runtime.logread import LogHeader, LogReader
from p2pactor.surface.replay import (
    ActorResult,
    InvariantViolation,
    LogInfo,
    ReplayRun,
    Summary,
    Unfinished,
)

JSON_FORMAT = 1
"""The version of the ``--json`` document's layout."""


def log_problem(log: LogInfo) -> str:
    """What is wrong with ``log``, and what it costs."""
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


def write_text(out: IO[str], run: ReplayRun, readers: list[LogReader], *, check: bool) -> None:
    """The text report: each actor's timeline as it ends, then the summary (and the checks)."""
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


def write_json(out: IO[str], run: ReplayRun, readers: list[LogReader], *, check: bool) -> None:
    """The ``--json`` document, its actors streamed out as they end."""
    headers = _headers(readers)
    # Written piece by piece so that the actors stream out as they end.
    out.write(f'{{"format": {JSON_FORMAT}, "check": {json.dumps(check)}, "actors": [')
    for i, result in enumerate(run):
        out.write(",\n" if i else "\n")
        out.write(json.dumps(_actor_json(result, headers.get(result.node_id))))
    warnings = [log_problem(log) for log in run.logs if log.problem is not None]
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
