"""The demo's orchestrator: start the node processes, show progress, summarise.

It starts one process per node, waits until every node is listening, tells each
its peers, follows their progress, stops them once all are done, then prints a
summary table, checks every event log with replay, and prints the command that
inspects them. The exit status is 0 only when every fetched byte was verified,
every answer was what the workload expects, every pin was released, and no
invariant broke.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

import attrs
import trio

from p2pactor.programs.demo.curve import ENV as CURVE_ENV
from p2pactor.programs.demo.curve import NodeCurve, demo_keys
from p2pactor.programs.demo.node import METRICS_HOST_ENV, METRICS_PORT_ENV, PREFIX
from p2pactor.programs.demo.summary import summarise
from p2pactor.programs.demo.workload import DemoPlan
from p2pactor.surface.replay import replay

__all__ = ["DemoReport", "run_demo"]


@attrs.define
class _Child:
    index: int
    process: trio.Process
    stderr_path: Path
    node_id: str = ""
    done: int = 0
    total: int = 0
    result: dict[str, Any] | None = None
    closed: dict[str, Any] | None = None
    dashboard: dict[str, str] | None = None
    http: str | None = None  # where its /metrics and /status are served


@attrs.define
class DemoReport:
    """What a demo run found.

    Attributes:
        ok: Every byte verified, every answer expected, nothing leaked, no violation.
        problems: What went wrong, one line each.
        log_dir: Where the event logs are.
        results: Each node's ``done`` message (its ``elapsed`` seconds from
            ``go`` and its requests' ``outcomes``), for programmatic callers
            such as ``p2pactor bench``.
    """

    ok: bool
    problems: list[str]
    log_dir: Path
    results: list[dict[str, Any]] = attrs.field(factory=list)


class _Progress:
    """A one-line progress bar on a terminal; plain lines otherwise."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self._stream = stream
        self._total = total
        self._tty = stream.isatty()
        self._last = -1

    def update(self, done: int) -> None:
        if self._tty:
            width = 30
            filled = width * done // max(self._total, 1)
            bar = "#" * filled + "." * (width - filled)
            self._stream.write(f"\r  [{bar}] {done}/{self._total} requests")
            self._stream.flush()
        elif done * 4 // max(self._total, 1) != self._last or done == self._total:
            self._last = done * 4 // max(self._total, 1)
            self._stream.write(f"  {done}/{self._total} requests done\n")
            self._stream.flush()

    def finish(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()


async def _read_lines(
    child: _Child, events: trio.MemorySendChannel[tuple[int, dict[str, Any]]]
) -> None:
    stdout = child.process.stdout
    assert stdout is not None
    buffer = b""
    async with events:  # the orchestrator's loop ends once every reader closed its clone
        async for chunk in stdout:
            buffer += chunk
            while b"\n" in buffer:
                raw, buffer = buffer.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if line.startswith(PREFIX):
                    await events.send((child.index, json.loads(line[len(PREFIX) :])))
        await events.send((child.index, {"event": "eof"}))


async def _send(child: _Child, message: dict[str, Any]) -> None:
    stdin = child.process.stdin
    assert stdin is not None
    await stdin.send_all(json.dumps(message).encode() + b"\n")


def _shown(url: str) -> str:
    """``url`` with a wildcard host as loopback, so that it can be opened as printed."""
    for wildcard in ("//0.0.0.0:", "//[::]:"):
        url = url.replace(wildcard, "//127.0.0.1:")
    return url


def _scrape_lines(children: list[_Child]) -> str:
    """Where to scrape each node: ``  node I metrics: URL  status: URL`` lines."""
    return "".join(
        f"  node {c.index} metrics: {_shown(c.http)}metrics  status: {_shown(c.http)}status\n"
        for c in children
        if c.http is not None
    )


def _dashboard_url(children: list[_Child]) -> str:
    """The first node's page, reading every node's feed (wildcard hosts as loopback)."""
    from p2pactor.surface.timeline import page_url  # noqa: PLC0415

    boards = [c.dashboard for c in children if c.dashboard is not None]
    return _shown(page_url(boards[0]["page"], [b["feed"] for b in boards]))


async def _linger(
    seconds: float | None, url: str, out: TextIO, children: list[_Child], deadline: trio.CancelScope
) -> None:
    """Keep the nodes (and their dashboards) up, then tell them to stop."""
    how_long = "until Ctrl-C" if seconds is None else f"for {seconds:g} s (Ctrl-C stops sooner)"
    if url:
        out.write(f"\nThe dashboard stays up {how_long}: {url}\n")
    else:
        out.write(f"\nThe nodes stay up {how_long}; scrape them at the URLs above\n")
    out.flush()
    left = deadline.deadline - trio.current_time()
    deadline.deadline = math.inf  # looking at the page is not the demo being slow
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        trio.move_on_after(math.inf if seconds is None else seconds),
    ):
        async for _ in signals:
            break
    deadline.deadline = trio.current_time() + left
    for c in children:
        await _send(c, {"stop": True})


async def _orchestrate(
    plan: DemoPlan,
    log_dir: Path,
    out: TextIO,
    limit: float,
    *,
    dashboard: tuple[str, int] | None = None,
    linger: float | None = 0.0,
    curve: list[NodeCurve] | None = None,
    wait_for_page: float = 0.0,
    pace: float = 0.0,
    metrics: tuple[str, int] | None = None,
) -> DemoReport:
    problems: list[str] = []
    summarised = False
    url = ""
    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    env.pop(CURVE_ENV, None)
    env.pop(METRICS_PORT_ENV, None)
    env.pop(METRICS_HOST_ENV, None)
    if metrics is not None and dashboard is None:  # with a dashboard, its ports serve them
        env[METRICS_HOST_ENV] = metrics[0]
    plan_json = json.dumps(attrs.asdict(plan))
    children: list[_Child] = []
    send_events, events = trio.open_memory_channel[tuple[int, dict[str, Any]]](1000)
    progress = _Progress(sys.stderr, plan.nodes * plan.requests)
    with trio.move_on_after(limit) as deadline:
        async with trio.open_nursery() as nursery:
            for index in range(plan.nodes):
                stderr_path = log_dir / f"node-{index}.stderr"
                with stderr_path.open("wb") as stderr:
                    process = await trio.lowlevel.open_process(
                        [
                            sys.executable,
                            "-m",
                            "p2pactor.programs.demo.node",
                            str(index),
                            plan_json,
                            str(log_dir),
                            *(
                                [f"{dashboard[0]}:{dashboard[1] + index if dashboard[1] else 0}"]
                                if dashboard
                                else []
                            ),
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=stderr,
                        env={
                            **env,
                            **({} if curve is None else {CURVE_ENV: curve[index].to_env()}),
                            **(
                                {METRICS_PORT_ENV: str(metrics[1] + index if metrics[1] else 0)}
                                if metrics is not None and dashboard is None
                                else {}
                            ),
                        },
                    )
                child = _Child(index, process, stderr_path)
                children.append(child)
                nursery.start_soon(_read_lines, child, send_events.clone())
            send_events.close()
            out.write(f"Starting {plan.nodes} nodes (ZeroMQ + NIXL on 127.0.0.1)...\n")
            if curve is not None:
                out.write(
                    "  control channel: CURVE, authenticated and encrypted; every node "
                    f"trusts the others' keys ({curve[0].trusted}, deleted at the end)\n"
                )
            out.flush()
            ready = 0
            async for index, message in events:
                child = children[index]
                kind = message.get("event")
                if kind == "ready":
                    child.node_id = message["node_id"]
                    child.dashboard = message.get("dashboard")
                    child.http = message.get("http")
                    ready += 1
                    if ready == plan.nodes:
                        peers = [c.node_id for c in children]
                        out.write(
                            "  " + "  ".join(f"node {c.index}: {c.node_id}" for c in children)
                        )
                        if metrics is not None:  # docs/metrics.md
                            out.write("\n" + _scrape_lines(children).rstrip("\n"))
                        go: dict[str, Any] = {"go": True, "peers": peers, "pace": pace}
                        if dashboard is not None:
                            url = _dashboard_url(children)
                            out.write(f"\ndashboard: {url}")
                            go["feeds"] = [c.dashboard["feed"] for c in children if c.dashboard]
                            go["wait_for_page"] = wait_for_page
                            if wait_for_page > 0:
                                out.write(
                                    "\nOpen it: the requests start when the page connects "
                                    f"(or in {wait_for_page:g} s; --wait-for-page 0 starts at once)"
                                )
                        out.write("\nRunning requests...\n")
                        out.flush()
                        for c in children:
                            await _send(c, go)
                elif kind == "progress":
                    child.done = message["done"]
                    progress.update(sum(c.done for c in children))
                elif kind == "done":
                    child.result = message
                    if all(c.result is not None for c in children):
                        progress.finish()
                        if (dashboard is not None or metrics is not None) and linger != 0:
                            summarise(
                                plan,
                                [(c.index, c.node_id, c.result) for c in children],
                                out,
                                problems,
                            )
                            summarised = True
                            nursery.start_soon(_linger, linger, url, out, children, deadline)
                        else:
                            for c in children:
                                await _send(c, {"stop": True})
                elif kind == "closed":
                    child.closed = message
                elif kind == "eof" and child.closed is None:
                    problems.append(f"node {index} stopped early (see {child.stderr_path})")
                    nursery.cancel_scope.cancel()
            for c in children:
                await c.process.wait()
    if deadline.cancelled_caught:
        problems.append(f"the demo did not finish within {limit:g} s")
    for c in children:
        if c.process.returncode is None:
            c.process.kill()
            await c.process.wait()
        if c.process.returncode not in (0, None) and not problems:
            problems.append(
                f"node {c.index} exited with {c.process.returncode} (see {c.stderr_path})"
            )
        if c.closed is not None and (c.closed["held_jobs"] or c.closed["open"]):
            problems.append(
                f"node {c.index} closed with {c.closed['held_jobs']} pins held and "
                f"{c.closed['open']} synthetic requests open"
            )
    if not summarised:
        summarise(plan, [(c.index, c.node_id, c.result) for c in children], out, problems)
    paths = sorted(Path(p) for p in await trio.Path(log_dir).glob("node-*.p2plog"))
    if paths:
        result = replay(paths, check=True)
        problems.extend(f"invariant broken: {v}" for v in result.violations)
        out.write(
            f"\nEvent logs: {log_dir}  ({result.summary.events} events, "
            f"{len(result.violations)} invariant violations)\n"
            f"Inspect them: {_p2pactor_command()} replay --check "
            f"{' '.join(shlex.quote(str(p)) for p in paths)}\n"
        )
    results = [c.result for c in children if c.result is not None]
    return DemoReport(ok=not problems, problems=problems, log_dir=log_dir, results=results)


def _p2pactor_command() -> str:
    """How the user can run ``p2pactor`` from their shell, as exactly as we know it."""
    beside = Path(sys.executable).parent / "p2pactor"
    on_path = shutil.which("p2pactor")
    if on_path is not None and (not beside.exists() or Path(on_path).samefile(beside)):
        return "p2pactor"
    if beside.exists():
        try:
            return str(beside.relative_to(Path.cwd()))
        except ValueError:
            return str(beside)
    return f"{shlex.quote(sys.executable)} -m p2pactor"


def run_demo(
    plan: DemoPlan,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    out: TextIO = sys.stdout,
    timeout: float = 120.0,
    dashboard: tuple[str, int] | None = None,
    linger: float | None = 0.0,
    curve: bool = False,
    wait_for_page: float = 0.0,
    pace: float = 0.0,
    metrics: tuple[str, int] | None = ("127.0.0.1", 0),
) -> DemoReport:
    """Run the demo and print its summary to ``out``; see the module docstring.

    With ``dashboard`` (host, port), node ``i`` serves its live timeline on
    ``port + i`` (every node on a free port when ``port`` is 0), and the first
    node's page, reading every node's feed, is printed as ``dashboard: URL``
    before the requests run. ``linger`` keeps the nodes and their dashboards
    up that many seconds after the summary (None: until Ctrl-C or SIGTERM).
    ``wait_for_page`` holds the requests until a page subscribes to the feeds
    (at most that many seconds, not counted in ``timeout``), so it sees them
    from their start; ``pace`` starts each node's requests that far apart.
    With ``curve``, the control channel is CURVE: keys for every node are made
    in a temporary folder (deleted at the end), and every node trusts the others.
    With ``metrics`` (host, port), every node serves ``/metrics`` and
    ``/status`` (``docs/metrics.md``): on its dashboard's port with
    ``dashboard``, else node ``i`` on ``port + i`` (free ports when ``port`` is
    0); where is printed per node before the requests run. None serves none.
    """
    if log_dir is None:
        folder = Path(tempfile.mkdtemp(prefix="p2pactor-demo-"))
    else:
        folder = Path(log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("node-*.p2plog"):
            old.unlink()
    with demo_keys(plan.nodes) if curve else contextlib.nullcontext() as keys:
        orchestrate = functools.partial(
            _orchestrate,
            dashboard=dashboard,
            linger=linger,
            curve=keys,
            wait_for_page=wait_for_page,
            pace=pace,
            metrics=metrics,
        )
        report = trio.run(orchestrate, plan, folder, out, timeout + wait_for_page)
    if report.ok:
        out.write(
            "\nDemo OK: every fetched byte verified, every pin released, no invariant broken.\n"
        )
    else:
        out.write("\nDemo FAILED:\n" + "".join(f"  - {p}\n" for p in report.problems))
    return report
