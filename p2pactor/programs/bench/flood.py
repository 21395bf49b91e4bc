"""Flood: an honest peer's lookup latency while a hostile peer floods the producer.

Per producer, three kinds of process on 127.0.0.1 over real ZeroMQ and NIXL:

* the **producer**, holding 4,096 blocks of 1 KiB in an
  :class:`~p2pactor.runtime.parent.EmbeddedCache` (:mod:`p2pactor.programs.bench._control_peer`,
  the ``control`` section's producers). Ours: a p2pactor node serving from the
  cache as its embedded parent, with its **default per-peer quotas** (a peer
  may pin 1,024 of the 4,096 blocks and keep 4,096 requests open), no event
  log. vLLM's: its ``P2PSecondaryTierManager`` woken when its ROUTER is
  readable (else every 1 ms), serving from a vLLM ``ParentManager`` over the
  same cache class; it has no quotas.
* the **honest peer**, a p2pactor node (:mod:`p2pactor.programs.bench._honest`):
  again and again, a lookup of 16 keys the producer holds, a fetch of the 16
  blocks, each verified byte for byte, then a 10 ms pause. The figure is the
  **lookup** latency, from the ``Node.lookup`` call to its answers; the fetch
  is there so that the honest peer does the whole job, and every byte must
  verify.
* the **hostile peer** (:mod:`p2pactor.programs.bench._hostile` ``--attack lookup-flood``,
  bare pyzmq in vLLM's dialect, so it floods both producers alike): a fresh process and
  session per flood, 100,000 lookups (``--quick``: 3,000) of 16 keys the
  producer holds, each under a fresh request id, never fetched, never closed,
  at most 256 unanswered at once.

Each repeat measures the honest peer for a fixed time with no hostile peer
(unflooded), then for as long as one flood lasts (flooded); then the hostile
peer disconnects and exits, and the honest peer works again until the
producer's CPU is back to what it used unflooded (the producer may still be
dropping the hostile session's requests: how long it takes, and the slowest
honest lookup meanwhile, are reported too). All processes start together; the
two producers are measured one after the other (vLLM's processes stopped,
before any session, while ours run), since a flood can outlast ZeroMQ's 10 s
heartbeat. Reported per producer: honest lookup p50 and p99 unflooded and
flooded (medians over repeats, with [min..max]), flooded p99 / unflooded p99
per repeat, the hostile lookups/s and the share of its keys answered HIT, the
producer's CPU during the flood, and the most blocks the hostile peer had
pinned at once (counted by the producer's cache) against the quota; and ours
flooded p99 / vLLM's flooded p99, repeat by repeat. The section fails (raises)
if an honest lookup answered MISS, a fetch failed or a byte differed, or the
hostile peer ever held more pinned blocks on our node than its quota; but not
when vLLM's producer stopped answering altogether, as it may when a hostile
peer leaves (:func:`_check`): that is noted, and vLLM's side measured no more.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pactor.programs.bench._control_common import (
    LineProcess,
    child_env,
    free_port,
    module_command,
    nixl_missing,
    process_cpu_s,
    ratio_or_none,
    vllm_missing,
)
from p2pactor.programs.bench._control_peer import BLOCK_LEN, HASH_SEED, HOST, NUM_KEYS
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat
from p2pactor.runtime.quotas import PeerQuotas

__all__ = ["FLOOD_LOOKUPS", "NAME", "QUICK_FLOOD_LOOKUPS", "TITLE", "run"]

NAME = "flood"
"""The section's name."""
TITLE = "an honest peer's lookup latency while a hostile peer floods the producer, ours vs vLLM's"
"""One line saying what is measured."""

FLOOD_LOOKUPS = 100_000
"""Hostile lookups per flood in a full run."""
QUICK_FLOOD_LOOKUPS = 3_000
"""Hostile lookups per flood with ``--quick``."""
HOSTILE_KEYS = 16
"""Keys per hostile lookup."""
HOSTILE_WINDOW = 256
"""Hostile lookups unanswered at once (more, and our transport drops it as a flood)."""
UNFLOODED_S = 10.0
"""The unflooded window of a full run (seconds)."""
QUICK_UNFLOODED_S = 1.5
"""The unflooded window with ``--quick``."""
SETTLE_S = 1.0
"""Pause after each flood once the producer is quiet again."""
QUICK_SETTLE_S = 0.5
"""The pause after each flood with ``--quick``."""
QUIET_MARGIN_CORES = 0.1
"""The producer is quiet again when it uses at most its idle CPU plus this."""
QUIET_SAMPLE_S = 0.2
"""How long each reading of the producer's CPU lasts while waiting for it to be quiet."""
QUIET_CAP_S = 60.0
"""The longest wait for the producer to be quiet after a flood."""
MAX_REPEATS = 3
"""At most this many repeats: one ours flood of 100,000 lookups is about a minute."""
GREETING_S = 2.0
"""How long a producer's ZeroMQ socket may take to greet a new connection before it is stuck."""
PRODUCER = "p2pactor.programs.bench._control_peer"
HONEST = "p2pactor.programs.bench._honest"
HOSTILE = "p2pactor.programs.bench._hostile"
SIDE_NAMES = {"ours": "ours", "vllm": "vLLM"}
"""How each producer is named in the table."""


def _quota() -> int:
    """Our producer's pinned-blocks quota per peer: the default share of its blocks."""
    return PeerQuotas().pinned_blocks_limit(NUM_KEYS)


class _Side:
    """One producer and its honest peer."""

    def __init__(self, side: str, work_dir: str) -> None:
        self.side = side
        self.work_dir = work_dir
        self.port, honest_port = free_port(), free_port()
        self.producer = LineProcess(
            PRODUCER,
            f"--side={side}",
            "--role=producer",
            f"--port={self.port}",
            "--default-quotas",
            stderr=str(Path(work_dir) / f"flood-{side}-producer.err"),
            PYTHONHASHSEED="0",
        )
        self.honest = LineProcess(
            HONEST,
            f"--port={honest_port}",
            f"--victim=127.0.0.1:{self.port}",
            "--keys=16",
            "--pause=0.01",
            stderr=str(Path(work_dir) / f"flood-{side}-honest.err"),
            PYTHONHASHSEED="0",
        )
        self.floods = 0
        self.hostile_peers: list[str] = []

    def ready(self) -> None:
        self.producer.wait_ready()
        self.honest.wait_ready()

    def pause(self, *, paused: bool) -> None:
        for proc in (self.honest, self.producer):
            proc.pause(paused=paused)

    def wait_quiet(self, usual_cores: float) -> float:
        """Wait until the producer uses about ``usual_cores`` again; the seconds it took.

        A producer may keep working after the hostile peer left (dropping its
        session's requests); the next unflooded window must not measure that.
        """
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < QUIET_CAP_S:
            cpu0, s0 = process_cpu_s(self.producer.pid), time.perf_counter()
            time.sleep(QUIET_SAMPLE_S)
            if _cores(cpu0, s0, self.producer.pid) <= usual_cores + QUIET_MARGIN_CORES:
                break
        return time.perf_counter() - t0

    def honest_for(self, seconds: float) -> dict[str, Any]:
        """The honest peer alone for ``seconds``: its figures, and the producer's CPU."""
        cpu0, t0 = process_cpu_s(self.producer.pid), time.perf_counter()
        self.honest.ask({"cmd": "start"})
        time.sleep(seconds)
        result = self.honest.ask({"cmd": "stop"})
        result["producer_cores"] = _cores(cpu0, t0, self.producer.pid)
        return result

    def flooded(self, lookups: int, usual_cores: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """The honest peer while one hostile peer floods ``lookups`` lookups, and as it leaves.

        Returns the honest peer's figures during the flood (with the hostile
        peer's), and from the hostile peer's ``disconnect`` until the producer
        is back to ``usual_cores`` (its CPU in the unflooded window).
        """
        self.floods += 1
        err_path = Path(self.work_dir) / f"flood-{self.side}-hostile-{self.floods}.err"
        with open(err_path, "w") as err:
            hostile = subprocess.Popen(  # noqa: S603 - runs our own helper module
                module_command(
                    HOSTILE,
                    "--attack=lookup-flood",
                    f"--victim=127.0.0.1:{self.port}",
                    f"--hash-seed={HASH_SEED}",
                    f"--block-len={BLOCK_LEN}",
                    f"--bench-keys={NUM_KEYS}",
                    f"--phase=real:{lookups}",
                    f"--keys={HOSTILE_KEYS}",
                    f"--window={HOSTILE_WINDOW}",
                    f"--seed={self.floods}",
                    "--linger",
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=child_env(PYTHONHASHSEED="0"),
            )
        try:
            # The honest peer is timed only while the flood runs: not while the
            # hostile process starts (imports, NIXL) or leaves.
            peer = _expect(hostile, "READY ", err_path).split()[1]
            self.hostile_peers.append(peer)
            cpu0, t0 = process_cpu_s(self.producer.pid), time.perf_counter()
            self.honest.ask({"cmd": "start"})
            phase = _expect(hostile, "PHASE ", err_path)
            honest = self.honest.ask({"cmd": "stop"})
            honest["producer_cores"] = _cores(cpu0, t0, self.producer.pid)
            # Now the hostile peer leaves, its session and requests with it; the
            # honest peer goes back to work once it is gone, while the producer
            # may still be dropping what the hostile session left.
            assert hostile.stdin is not None
            left = time.perf_counter()
            hostile.stdin.close()
            hostile.wait(timeout=60)
            self.honest.ask({"cmd": "start"})
            self.wait_quiet(usual_cores)
            leaving = self.honest.ask({"cmd": "stop"})
            leaving["busy_after_s"] = time.perf_counter() - left
        finally:
            if hostile.poll() is None:
                hostile.kill()
                hostile.wait()
        honest["hostile"] = json.loads(phase.split(" ", 1)[1])
        honest["hostile_peer"] = peer
        return honest, leaving

    def close(self) -> dict[str, Any]:
        self.pause(paused=False)
        self.honest.close()
        return self.producer.close()

    def kill(self) -> None:
        self.honest.kill()
        self.producer.kill()


def _cores(cpu0: float, t0: float, pid: int) -> float:
    wall = time.perf_counter() - t0
    return (process_cpu_s(pid) - cpu0) / wall if wall > 0 else 0.0


def _expect(proc: subprocess.Popen[str], prefix: str, err_path: Path) -> str:
    """The hostile peer's next line starting with ``prefix``; raise on ERROR or exit."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.strip()
        if line.startswith(prefix):
            return line
        if line.startswith("ERROR"):
            raise RuntimeError(f"the hostile peer failed: {line}")
    tail = err_path.read_text()[-1500:].strip() if err_path.exists() else ""
    raise RuntimeError(
        f"the hostile peer exited with {proc.wait()} before {prefix.strip()}: {tail}"
    )


def run(options: BenchOptions) -> SectionResult:
    """Measure both producers unflooded and flooded, one after the other, and tabulate."""
    no_nixl = nixl_missing()
    if no_nixl:
        return SectionResult(name=NAME, title=TITLE, skipped=no_nixl)
    missing = vllm_missing()
    sides = ["ours"] if missing else ["ours", "vllm"]
    repeats = max(1, min(options.repeats, MAX_REPEATS))
    lookups = QUICK_FLOOD_LOOKUPS if options.quick else FLOOD_LOOKUPS
    unflooded_s = QUICK_UNFLOODED_S if options.quick else UNFLOODED_S
    settle_s = QUICK_SETTLE_S if options.quick else SETTLE_S
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    procs: dict[str, _Side] = {}
    runs: dict[str, list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]] = {
        s: [] for s in sides
    }
    counters: dict[str, dict[str, Any]] = {}
    stopped: dict[str, str] = {}
    t0 = time.perf_counter()
    try:
        for side in sides:  # all start at once: their imports overlap
            procs[side] = _Side(side, options.work_dir)
        for p in procs.values():
            p.ready()
        startup = time.perf_counter() - t0
        for side in sides:
            for other, p in procs.items():
                if other != side:
                    p.pause(paused=True)  # no session yet: nothing can time out
            p = procs[side]
            p.pause(paused=False)
            warm = p.honest_for(0.5)  # the handshake and the first requests' one-off costs
            stop = _check(p, "warm-up", warm)
            for _ in range(repeats if stop is None else 0):
                base = p.honest_for(unflooded_s)
                stop = _check(p, "unflooded", base)
                if stop is not None:
                    break
                flood, leaving = p.flooded(lookups, float(base["producer_cores"]))
                stop = _check(p, "flooded", flood) or _check(p, "as the hostile peer left", leaving)
                runs[side].append((base, flood, leaving))
                if stop is not None:
                    break
                time.sleep(settle_s)
            if stop is not None:
                stopped[side] = stop
            counters[side] = p.close()
    finally:
        for p in procs.values():
            p.kill()
    return _tabulate(
        sides=sides,
        runs=runs,
        counters=counters,
        stopped=stopped,
        hostile_peers={s: p.hostile_peers for s, p in procs.items()},
        missing=missing,
        lookups=lookups,
        unflooded_s=unflooded_s,
        settle_s=settle_s,
        repeats=repeats,
        startup=startup,
    )


def _check(p: _Side, window: str, result: dict[str, Any]) -> str | None:
    """Fail the section if the honest peer saw a MISS, a failed fetch or a wrong byte.

    Except on vLLM's producer, when every failure is a lost session and its
    ZeroMQ socket no longer greets a new connection: its ZeroMQ I/O thread is
    stuck for good. vLLM 0.33.0 gets there as a peer leaves: closing its DEALER
    to the peer, it closes the DEALER's monitor socket first, and an event the
    DEALER emits after that (it reconnects to the gone peer while it lingers;
    surely so when a frame of the peer's came after its session was reaped and
    vLLM dialed it back) is one no one reads, which libzmq's I/O thread sends
    blocking. Every session to that producer then dies of the heartbeat
    timeout, its requests answering MISS as p2pactor answers for any lost
    peer. vLLM's bug, not ours: the note saying so is returned, and the
    section measures that producer no more.
    """
    if result.get("failed"):
        what = (
            f"{p.side} producer, {window}: {result['failed']} honest request(s) failed: "
            f"{'; '.join(result['failures'])}"
        )
        lost = result["failed"] == result["lost_session"]
        if p.side == "vllm" and lost and not _greets(p.port):
            return (
                f"vLLM's producer stopped answering ({what}); its port no longer greets a "
                "ZeroMQ connection: its ZeroMQ I/O thread is stuck, which vLLM 0.33.0 does "
                "as a peer leaves (see flood.py's _check); its repeats from then on skipped"
            )
        raise RuntimeError(what)
    if not result.get("lookups"):
        raise RuntimeError(f"{p.side} producer, {window}: the honest peer made no lookup")
    return None


def _greets(port: int) -> bool:
    """Whether the ZeroMQ socket bound at ``port`` still sends a new connection its greeting.

    libzmq's I/O thread greets at once; while that thread is stuck the kernel
    still accepts the connection, but no byte comes.
    """
    try:
        with socket.create_connection((HOST, port), timeout=GREETING_S) as conn:
            conn.settimeout(GREETING_S)
            return conn.recv(1) == b"\xff"  # the first byte of the ZMTP signature
    except OSError:
        return False


def _ms(results: Sequence[dict[str, Any]], key: str) -> Stat:
    return Stat.of(float(r[key]) * 1e3 for r in results)


def _tabulate(
    *,
    sides: Sequence[str],
    runs: dict[str, list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]],
    counters: dict[str, dict[str, Any]],
    stopped: dict[str, str],
    hostile_peers: dict[str, list[str]],
    missing: str | None,
    lookups: int,
    unflooded_s: float,
    settle_s: float,
    repeats: int,
    startup: float,
) -> SectionResult:
    quota = _quota()
    rows: list[dict[str, Cell]] = []
    ratios: dict[str, Stat] = {}
    flooded_p99: dict[str, list[float]] = {}
    growth: dict[str, float] = {}
    notes: list[str] = []
    verified = 0
    for side in sides:
        if not runs[side]:
            continue  # it stopped answering before a repeat ended: the note says so
        base = [b for b, _, _ in runs[side]]
        flood = [f for _, f, _ in runs[side]]
        leaving = [x for _, _, x in runs[side]]
        verified += sum(int(r["verified"]) for r in base + flood + leaving)
        peaks = counters.get(side, {}).get("peak_pinned_by_peer", {})
        peak = max((int(peaks.get(p, 0)) for p in hostile_peers[side]), default=0)
        if side == "ours" and peak > quota:
            raise RuntimeError(
                f"the hostile peer had {peak} blocks pinned on our producer at once; "
                f"its quota is {quota}"
            )
        per_repeat = [
            r
            for b, f, _ in runs[side]
            if (r := ratio_or_none(f["lookup_p99_s"], b["lookup_p99_s"])) is not None
        ]
        name = SIDE_NAMES[side]
        flooded_p99[side] = [float(f["lookup_p99_s"]) for f in flood]
        hit_keys = sum(int(f["hostile"]["keys_hit"]) for f in flood)
        row: dict[str, Cell] = {
            "producer": name,
            "honest lookups": f"{sum(int(r['lookups']) for r in base)}"
            f" / {sum(int(r['lookups']) for r in flood)}",
            "unflooded p50 ms": _ms(base, "lookup_p50_s"),
            "unflooded p99 ms": _ms(base, "lookup_p99_s"),
            "flooded p50 ms": _ms(flood, "lookup_p50_s"),
            "flooded p99 ms": _ms(flood, "lookup_p99_s"),
            "flooded/unflooded p99": Stat.of(per_repeat) if per_repeat else None,
            "hostile lookups/s": Stat.of(float(f["hostile"]["lookups_per_s"]) for f in flood),
            "hostile keys HIT": f"{hit_keys / (len(flood) * lookups * HOSTILE_KEYS):.1%}",
            "producer cores flooded": Stat.of(float(f["producer_cores"]) for f in flood),
            "busy after it left s": Stat.of(float(x["busy_after_s"]) for x in leaving),
            "as it left max ms": _ms(leaving, "lookup_max_s"),
            "hostile peak pinned": peak,
            "pinned quota": quota if side == "ours" else "none",
        }
        rows.append(row)
        if per_repeat:
            ratios[f"flooded p99 / unflooded p99, {name}"] = Stat.of(per_repeat)
            growth[side] = Stat.of(per_repeat).median
        held = counters.get(side, {}).get("pinned_by_peer", {})
        left = {p: n for p, n in held.items() if p in hostile_peers[side]}
        if left:
            notes.append(f"{name} producer still held pins of hostile peers at the end: {left}")
    ours_vs_vllm: Stat | None = None
    if "vllm" in flooded_p99:
        # vLLM's side has fewer repeats if its producer stopped answering.
        pairs = [
            r
            for a, b in zip(flooded_p99["ours"], flooded_p99["vllm"], strict=False)
            if (r := ratio_or_none(a, b)) is not None
        ]
        if pairs:
            ours_vs_vllm = ratios["flooded p99 ours/vLLM"] = Stat.of(pairs)
    notes[:0] = [
        (
            f"{repeats} repeat(s) per producer: the honest peer alone for {unflooded_s:g} s "
            f"(unflooded), then during one flood of {lookups:,} hostile lookups (flooded), "
            "then the hostile peer disconnects and exits, the honest peer goes back to work, "
            f"and the producer is watched until its CPU is back within {QUIET_MARGIN_CORES:g} "
            "core of what it used unflooded ('busy after it left': from the disconnect, at "
            f"most {QUIET_CAP_S:g} s more; 'as it left max' = the slowest honest lookup "
            f"meanwhile), then {settle_s:g} s more; processes started in {startup:.0f} s"
        ),
        (
            "honest peer: a p2pactor node; lookup of 16 keys the producer holds, then a fetch "
            "of the 16 blocks of 1 KiB, 10 ms pause; latency = the lookup alone (Node.lookup to "
            f"its answers); {verified} fetched blocks verified byte for byte, no MISS, no "
            f"failed fetch{' but where a producer stopped answering (below)' if stopped else ''}; "
            "honest lookups counted unflooded / flooded over all repeats"
        ),
        (
            f"hostile peer: bare pyzmq in vLLM's dialect, a fresh process and session per "
            f"flood, {HOSTILE_KEYS} real keys per lookup under a fresh request id, never "
            f"fetched or closed, at most {HOSTILE_WINDOW} unanswered; 'hostile keys HIT' = "
            "keys it got answered HIT (ours refuses pins over its quota and requests over "
            "its open-requests quota, answering MISS)"
        ),
        (
            "producers: ours = a p2pactor node with its default quotas, no event log; "
            "vLLM = P2PSecondaryTierManager woken when its ROUTER is readable (else every "
            "1 ms) over a vLLM ParentManager on the same EmbeddedCache class, no quotas; "
            "measured one after the other, the other's processes stopped (SIGSTOP); "
            "hostile peak pinned = the most blocks of the hostile peer's jobs pinned at "
            "once, counted by the producer's cache"
        ),
    ]
    notes.extend(stopped.values())
    if missing:
        notes.append(f"vLLM side skipped: {missing}")
    targets = []
    if "ours" in growth:
        g = growth["ours"]
        targets.append(
            f"ours flooded p99 <= 2x ours unflooded: {'met' if g <= 2 else 'missed'} (x{g:.2f})"
        )
    if ours_vs_vllm is not None:
        r = ours_vs_vllm.median
        targets.append(
            f"ours flooded p99 <= vLLM's flooded p99: {'met' if r <= 1 else 'missed'} (x{r:.2f})"
        )
    if targets:
        notes.append("targets (issue; not asserted): " + "; ".join(targets))
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)
