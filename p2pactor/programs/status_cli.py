"""``p2pactor status HOST:PORT``: a running node's status, as a table or as JSON.

It reads ``http://HOST:PORT/status`` (the node's dashboard port, or its
metrics port; see ``docs/status.md``) and prints the node, its thread's slow
steps (``loop``), one row per peer (session state, dialect, last activity,
requests, transfers, pins), then the node's limits and each peer's quotas with
how much of each is used.
``--json`` prints the node's answer as it came.

Exit status: 0 when the node answered; 1 when it did not (nothing listening,
no answer in time, not a p2pactor status), with one line on stderr saying what
to check.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import urllib.error
import urllib.request
from typing import Any, Final, TextIO

__all__ = ["StatusUnavailable", "fetch_status", "format_status", "register", "run", "status_url"]

_PROG: Final = "p2pactor status"
_MAX_BODY: Final = 64 * 2**20  # a status of thousands of peers is a few MB


class StatusUnavailable(Exception):
    """The node's status could not be read; the message says what to check."""


def register(commands: Any) -> None:
    """Add ``status`` to the command line's subcommands."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "status",
        help="show a running node's peers, sessions, requests, pins and limits",
        description=(
            "Read a running node's GET /status (on its dashboard or metrics port) and print "
            "it as a table: the node, one row per peer, then its limits and each peer's "
            "quotas with how much is used. See docs/status.md."
        ),
    )
    parser.add_argument(
        "address",
        metavar="HOST:PORT",
        help="the node's dashboard or metrics port (not its control port), e.g. 127.0.0.1:8080",
    )
    parser.add_argument("--json", action="store_true", help="print the node's JSON answer as is")
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the answer (default %(default)s)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Fetch and print the status; the exit status."""
    try:
        status = fetch_status(args.address, timeout=args.timeout)
    except StatusUnavailable as exc:
        sys.stderr.write(f"{_PROG}: {exc}\n")
        return 1
    out = sys.stdout
    if args.json:
        json.dump(status, out, indent=2, sort_keys=True)
        out.write("\n")
    else:
        format_status(status, out)
    out.flush()
    return 0


def status_url(address: str) -> str:
    """``http://HOST:PORT/status`` for ``HOST:PORT`` (a full ``http://`` URL is kept)."""
    if address.startswith(("http://", "https://")):
        base = address.rstrip("/")
        return base if base.endswith("/status") else base + "/status"
    return f"http://{address}/status"


def fetch_status(address: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """The JSON a node answers at ``http://HOST:PORT/status``.

    Raises:
        StatusUnavailable: Nothing answered, not in time, not with 200, or
            not with a p2pactor status; the message says what to check.
    """
    url = status_url(address)
    if timeout <= 0:
        raise StatusUnavailable(f"--timeout must be more than 0 seconds, got {timeout:g}")
    hint = (
        f"check that a p2pactor node serves its dashboard or metrics on {address} "
        "(p2pactor serve --dashboard PORT or --metrics-port PORT; that port, not the control port)"
    )
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http only)
            body = response.read(_MAX_BODY + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(200).decode(errors="replace").strip()
        said = f" ({detail})" if detail else ""
        if exc.code == 404:
            raise StatusUnavailable(
                f"{url} answered 404{said}: this server has no /status; {hint}"
            ) from None
        raise StatusUnavailable(f"{url} answered HTTP {exc.code}{said}; {hint}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            raise StatusUnavailable(
                f"nothing listens at {address} (connection refused); {hint}"
            ) from None
        if isinstance(reason, TimeoutError):
            raise StatusUnavailable(f"no answer from {url} within {timeout:g} s; {hint}") from None
        if isinstance(reason, socket.gaierror):
            raise StatusUnavailable(
                f"cannot resolve the host of {address} ({reason}); give HOST:PORT of the node"
            ) from None
        raise StatusUnavailable(f"could not reach {url}: {reason}; {hint}") from None
    except TimeoutError:
        raise StatusUnavailable(f"no answer from {url} within {timeout:g} s; {hint}") from None
    except (OSError, ValueError) as exc:  # reset mid-answer, a malformed address...
        raise StatusUnavailable(f"could not read {url}: {exc}; {hint}") from None
    if len(body) > _MAX_BODY:
        raise StatusUnavailable(f"{url} answered more than {_MAX_BODY} bytes; {hint}")
    try:
        status = json.loads(body)
    except ValueError:
        raise StatusUnavailable(f"{url} did not answer JSON; {hint}") from None
    if not isinstance(status, dict) or "node_id" not in status:
        raise StatusUnavailable(f"{url} answered JSON that is not a node's status; {hint}")
    return status


# --- the table ----------------------------------------------------------------------------


def format_status(status: dict[str, Any], out: TextIO) -> None:
    """Write ``status`` (as :func:`p2pactor.surface.status.node_status` makes it) as tables."""
    control = status.get("control") or {}
    out.write(
        f"node {status['node_id']}  p2pactor {status.get('version', '?')}  "
        f"up {_duration(status.get('uptime_s'))}  security {control.get('security', '?')}\n"
    )
    requests = status.get("requests") or {}
    transfers = status.get("transfers") or {}
    pins = status.get("pins") or {}
    peers: list[dict[str, Any]] = status.get("peers") or []
    out.write(
        f"{_plural(len(peers), 'peer')}; requests in flight: {requests.get('consumer', 0)} ours, "
        f"{requests.get('producer', 0)} theirs; transfers: {transfers.get('loads', 0)} loads, "
        f"{transfers.get('writes', 0)} writes; pins: {pins.get('jobs', 0)} jobs, "
        f"{pins.get('blocks', 0)} blocks\n"
    )
    loop = status.get("loop")
    if isinstance(loop, dict):  # a node from before the slow-step watch has none
        out.write(_loop_line(loop, status) + "\n")
    out.write("\n")
    rows = [
        [
            "PEER",
            "STATE",
            "DIALECT",
            "LAST ACTIVITY",
            "REQS OURS/THEIRS",
            "LOADS/WRITES",
            "PINS JOBS/BLOCKS",
        ]
    ]
    for peer in peers:
        req, xfer, pin = peer["requests"], peer["transfers"], peer["pins"]
        rows.append(
            [
                peer["peer"],
                _state(peer),
                peer.get("dialect", "?"),
                _ago(peer.get("last_activity_s")),
                f"{req['consumer']}/{req['producer']}",
                f"{xfer['loads']}/{xfer['writes']}",
                f"{pin['jobs']}/{pin['blocks']}",
            ]
        )
    if peers:
        _table(rows, out)
    else:
        out.write("no peers: no session is open\n")
    out.write("\n")
    limit_rows = [["LIMIT", "USED", "OF", "USED %"]]
    limit_rows += [_limit_row(limit["name"], limit) for limit in status.get("limits") or []]
    # A peer's quotas at zero say nothing; with many peers they would drown the rest.
    used = [
        (peer["peer"], quota)
        for peer in peers
        for quota in peer.get("quotas") or []
        if quota.get("used")
    ]
    limit_rows += [_limit_row(f"{peer} {quota['name']}", quota) for peer, quota in used]
    _table(limit_rows, out)
    idle = len(peers) - len({peer for peer, _ in used})
    if idle:
        out.write(
            f"({_plural(idle, 'peer')} using none of their quotas not shown; --json has all)\n"
        )
    closed = status.get("closed_sessions") or {}
    recent = closed.get("recent") or []
    if recent:
        last = recent[0]
        out.write(
            f"\n{closed.get('total', len(recent))} sessions closed; the last: "
            f"{last['peer']}: {last['reason']}\n"
        )


def _loop_line(loop: dict[str, Any], status: dict[str, Any]) -> str:
    """The slow-step watch in one line (docs/status.md, ``loop``)."""
    threshold = loop.get("slow_step_s")
    if threshold is None:
        return "loop: slow-step watch off (p2pactor serve --slow-step-ms MS turns it on)"
    slow = loop.get("slow_steps", 0)
    line = (
        f"loop: {loop.get('steps', 0)} steps, {slow or 'none'} slow "
        f"(>= {_ms(threshold)}); longest {_ms(loop.get('longest_step_s', 0.0))}"
    )
    recent = loop.get("recent_slow") or []
    if recent:
        last = recent[0]
        now = status.get("started_at", 0.0) + status.get("uptime_s", 0.0)
        line += (
            f"; the last: {last['task']} {_ms(last['seconds'])}, {_ago(max(0.0, now - last['at']))}"
        )
    return line


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _state(peer: dict[str, Any]) -> str:
    state = str(peer.get("state", "?"))
    if state == "connecting":
        steps = peer.get("handshake") or {}
        missing = [name for name, done in steps.items() if not done]
        return f"connecting (waiting: {missing[0]})" if missing else state
    return state


def _limit_row(name: str, limit: dict[str, Any]) -> list[str]:
    percent = limit.get("percent")
    shown = "-" if percent is None else f"{percent}%"
    return [name, str(limit["used"]), str(limit["limit"]), shown]


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            + "\n"
        )


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{_duration(seconds)} ago"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
