"""Measure how fast ``p2pactor replay`` goes through a big log, and in how much memory.

Writes a log of about a million events (the happy lookup -> fetch pair of
actors of ``tests/test_replay.py`` again and again, with distinct request ids,
16 pairs interleaved at a time), then replays it in fresh interpreters, one per
mode: reading only, replay, replay with invariant checks, and the command
``p2pactor replay LOG --check`` itself. Each prints its time, events per
second and how much its peak memory grew; for comparison, the memory that
holding every event would take is extrapolated from holding 100,000.

Run it from the repository root: ``python benchmarks/replay_speed.py``
(``--events`` sets the size, ``--log`` reuses or keeps a log file).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

# Run as a script from the repository root: make p2pactor and the scenarios importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pactor.programs.cli import main as cli_main
from p2pactor.runtime.log import Durability, EventLog, read_log
from p2pactor.surface.replay import replay_logs
from tests.test_replay import NODE_B, repeated_pattern

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_EVENTS = 100_000
"""How many events the 'hold everything' reference loads."""


def say(line: str) -> None:
    """Print one line of the report."""
    sys.stdout.write(line + "\n")


def peak_kib() -> int:
    """This process's peak resident memory (VmHWM: not inherited across fork)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (this benchmark needs Linux)")


def child(mode: str, path: str) -> None:
    """Run one mode and print its measurements as JSON."""
    before = peak_kib()
    start = time.perf_counter()
    events = 0
    if mode == "read":
        events = sum(1 for _ in read_log(path))
    elif mode in {"replay", "replay --check"}:
        run = replay_logs([path], check=mode.endswith("--check"), timelines=0)
        for _ in run:
            pass
        events = run.summary().events
        if run.violations:
            raise SystemExit(f"unexpected violations: {run.violations[:3]}")
    elif mode == "p2pactor replay --check":
        with contextlib.redirect_stdout(io.StringIO()) as out:
            status = cli_main(["replay", path, "--check"])
        if status != 0:
            raise SystemExit(f"exit status {status}:\n{out.getvalue()[-2000:]}")
        line = next(x for x in out.getvalue().splitlines() if x.startswith("  events "))
        events = int(line.split()[1])
    elif mode == "hold":
        held = list(islice(read_log(path), REFERENCE_EVENTS))
        events = len(held)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    seconds = time.perf_counter() - start
    growth = peak_kib() - before
    sys.stdout.write(json.dumps({"seconds": seconds, "events": events, "growth_kib": growth}))


def measure(mode: str, path: Path) -> dict[str, float]:
    """Run ``mode`` in a fresh interpreter."""
    done = subprocess.run(  # noqa: S603 - runs this very script
        [sys.executable, __file__, "--child", mode, str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def write(path: Path, total: int) -> None:
    """Write a log of about ``total`` events through an EventLog."""
    start = time.perf_counter()
    with EventLog(NODE_B, path=path, durability=Durability.interval(), keep=0) as log:
        batch = []
        for event in repeated_pattern(total):
            batch.append(event)
            if len(batch) == 3:
                log.append(batch)
                batch = []
        log.append(batch)
        written = log.statistics()
    seconds = time.perf_counter() - start
    say(
        f"wrote {written.events_appended:,} events ({written.bytes_written / 1e6:.0f} MB) "
        f"in {seconds:.1f}s: {written.events_appended / seconds:,.0f} events/s "
        "(generating them included)"
    )


def report(log: Path) -> None:
    """Measure every mode on ``log`` and print the table."""
    say(f"{'mode':<26} {'seconds':>8} {'events/s':>10} {'peak RSS growth':>16}")
    for mode in ("read", "replay", "replay --check", "p2pactor replay --check"):
        m = measure(mode, log)
        say(
            f"{mode:<26} {m['seconds']:>8.1f} {m['events'] / m['seconds']:>10,.0f} "
            f"{m['growth_kib'] / 1024:>12.1f} MiB"
        )
    events = sum(1 for _ in read_log(log))
    held = measure("hold", log)
    per_event = held["growth_kib"] * 1024 / held["events"]
    say(
        f"holding the events instead: {per_event:,.0f} bytes each, "
        f"about {per_event * events / 2**20:,.0f} MiB for all {events:,}"
    )


def main() -> None:
    """Write (or reuse) the log and measure every mode."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="log size in events")
    parser.add_argument("--log", type=Path, help="log file to reuse, or to keep")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "LOG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log or Path(tmp) / "big.log"
        if not log.exists():
            write(log, args.events)
        say(f"log: {log} ({os.path.getsize(log) / 1e6:.0f} MB)")
        report(log)


if __name__ == "__main__":
    main()
