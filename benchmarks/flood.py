"""A hostile peer floods a node with lookups while an honest peer works: what does it cost?

Three processes on 127.0.0.1, real ZeroMQ and real NIXL:

* the **victim**, ``p2pactor serve --preload N`` (N blocks, all preloaded, its
  default quotas unless ``--pinned-quota`` sets one through
  ``P2PACTOR_QUOTA_PINNED_BLOCKS``), writing its event log;
* the **hostile peer**, ``tests/flood_peer.py``: bare pyzmq sockets, the
  handshake, then ``--lookups`` lookups (100,000) of ``--keys`` keys each, every
  one under a fresh request id, never fetched, never closed, at most
  ``--window`` unanswered at once. One process per phase: **random** keys,
  then **real** keys (the ones the victim holds, so every admitted lookup pins),
  then **rounds**: real keys, all lookups in one request, each for a new round
  (what the rounds-per-request quota stops);
* the **honest peer**, a p2pactor node in this process: lookup 16 real keys,
  fetch them over NIXL, verify every byte, finish; again and again, with a
  short pause, before the flood (**baseline**) and during each flood phase.

Reported: the victim's peak RSS (``VmHWM``) and its RSS at the end of each
phase, the most blocks each hostile session had pinned at once (from the
victim's own count, printed by ``serve`` at exit, and recomputed from its event
log), its refusals by quota, the hostile lookup rate, and the honest peer's
lookup and fetch latency (p50, p99, max) per phase, with every fetch verified.
The pinned-blocks figure must never exceed the quota: the script exits 1 if it
does, or if any honest fetch fails or any byte differs.

Run it from the repository root: ``.venv/bin/python benchmarks/flood.py``
(a few minutes on two cores); ``--quick`` floods 5,000 lookups per phase;
``--json PATH`` also writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

# Run as a script from the repository root: make p2pactor importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio

from p2pactor.adapters.nixl import open_nixl_transport
from p2pactor.adapters.zmq import open_zmq_transport
from p2pactor.config import NodeConfig
from p2pactor.core import events as ev
from p2pactor.core.inputs import LookupResult
from p2pactor.demo.workload import block_bytes
from p2pactor.log import read_log
from p2pactor.node import Node, open_node
from p2pactor.parent import EmbeddedCache
from p2pactor.serve import preload_keys

ROOT = Path(__file__).resolve().parent.parent
FLOOD_PEER = ROOT / "tests" / "flood_peer.py"
HASH_SEED = "flood-benchmark"
HONEST_KEYS = 16
PHASES = ("random", "real", "rounds")
"""The flood phases, one hostile process (session) each."""


def say(line: str = "") -> None:
    """Print one line of the report."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kib(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` memory field (VmRSS, VmHWM) in KiB; 0 once gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Victim:
    """``p2pactor serve`` in its own process, its output collected by a thread."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.port = free_port()
        self.node_id = f"127.0.0.1:{self.port}"
        self.log_path = workdir / "victim.p2plog"
        env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
        if args.pinned_quota is not None:
            env["P2PACTOR_QUOTA_PINNED_BLOCKS"] = str(args.pinned_quota)
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [
                sys.executable,
                "-m",
                "p2pactor",
                "serve",
                "--host=127.0.0.1",
                f"--port={self.port}",
                f"--num-blocks={args.blocks}",
                f"--block-len={args.block_len}",
                f"--preload={args.blocks}",
                f"--hash-seed={HASH_SEED}",
                f"--log={self.log_path}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if " serving " in line:
                self.ready.set()

    def rss_kib(self) -> int:
        """Its resident memory now."""
        return kib(self.proc.pid, "VmRSS")

    def peak_kib(self) -> int:
        """Its peak resident memory so far (VmHWM)."""
        return kib(self.proc.pid, "VmHWM")

    def stop(self) -> dict[str, dict[str, Any]]:
        """Stop it (SIGINT) and return the quota usage it printed, by peer."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=120)
        self._reader.join(timeout=10)
        usage = {}
        for line in self.lines:
            if line.startswith("quota usage "):
                _, _, peer, data = line.split(" ", 3)
                usage[peer] = json.loads(data)
        return usage


class Sampler:
    """The victim's RSS, sampled twice a second; the peak since the last reset."""

    def __init__(self, victim: Victim) -> None:
        self.victim = victim
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self.victim.rss_kib())

    def take(self) -> int:
        """The peak since the last call (and now), and start over."""
        peak, self.peak = max(self.peak, self.victim.rss_kib()), 0
        return peak

    def close(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank); NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Honest:
    """The honest peer's workload and its latencies."""

    def __init__(self, node: Node, cache: EmbeddedCache, pool: bytearray, args: argparse.Namespace):
        self.node = node
        self.cache = cache
        self.pool = pool
        self.args = args
        self.keys = preload_keys(HASH_SEED, args.blocks)
        self.expected = {k: block_bytes(k, args.block_len) for k in self.keys}
        self.iteration = 0
        self.failures: list[str] = []

    async def one(self, victim: str, lookups: list[float], fetches: list[float]) -> None:
        """One request: lookup, fetch, verify every byte, finish; record the latencies."""
        i = self.iteration
        self.iteration += 1
        kv = f"honest-{i}"
        start = (i * HONEST_KEYS) % (len(self.keys) - HONEST_KEYS + 1)
        wanted = self.keys[start : start + HONEST_KEYS]
        t0 = time.perf_counter()
        answers = await self.node.lookup(victim, kv, wanted)
        t1 = time.perf_counter()
        lookups.append(t1 - t0)
        if answers != [LookupResult.HIT] * len(wanted):
            self.failures.append(f"{kv}: lookup answered {answers.count(LookupResult.MISS)} MISS")
            self.node.finish(kv)
            return
        blocks = self.cache.allocate(len(wanted))
        try:
            result = await self.node.fetch(victim, kv, wanted, blocks)
            fetches.append(time.perf_counter() - t1)
            if not result.success:
                self.failures.append(f"{kv}: fetch failed: {result.reason}")
                return
            bl = self.args.block_len
            for k, block in zip(wanted, blocks, strict=True):
                if self.pool[block * bl : (block + 1) * bl] != self.expected[k]:
                    self.failures.append(f"{kv}: block of {k.hex()[:12]} differs")
        finally:
            self.cache.free(blocks)
            self.node.finish(kv)

    async def run(self, victim: str, until: Any, count: int | None = None) -> dict[str, Any]:
        """Run iterations until ``until()`` (and at least ``count`` if given)."""
        lookups: list[float] = []
        fetches: list[float] = []
        failed_before = len(self.failures)
        start = time.perf_counter()
        while not until() or (count is not None and len(lookups) < count):
            await self.one(victim, lookups, fetches)
            await trio.sleep(self.args.pause)
        ms = [x * 1000 for x in lookups]
        fms = [x * 1000 for x in fetches]
        return {
            "iterations": len(lookups),
            "seconds": round(time.perf_counter() - start, 1),
            "lookup_ms": {
                "p50": round(quantile(ms, 0.50), 2),
                "p99": round(quantile(ms, 0.99), 2),
                "max": round(max(ms, default=float("nan")), 2),
                "mean": round(statistics.fmean(ms), 2) if ms else None,
            },
            "fetch_ms": {
                "p50": round(quantile(fms, 0.50), 2),
                "p99": round(quantile(fms, 0.99), 2),
                "max": round(max(fms, default=float("nan")), 2),
            },
            "blocks_verified": len(fetches) * HONEST_KEYS,
            "failures": len(self.failures) - failed_before,
        }


async def hostile_phase(
    args: argparse.Namespace, victim: Victim, kind: str, honest: Honest, sampler: Sampler
) -> dict[str, Any]:
    """One hostile process flooding ``kind`` keys while the honest peer works."""
    flooder = await trio.lowlevel.open_process(
        [
            sys.executable,
            str(FLOOD_PEER),
            f"--victim={victim.node_id}",
            f"--hash-seed={HASH_SEED}",
            f"--block-len={args.block_len}",
            f"--preload={args.blocks}",
            f"--phase={kind}:{args.lookups}",
            f"--keys={args.keys}",
            f"--window={args.window}",
            f"--seed={hash(kind) & 0xFFFF}",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
    )
    lines: list[str] = []
    flooding = trio.Event()  # the hostile peer is through its handshake and floods
    done = trio.Event()  # its flood is over (or it failed)

    async def read() -> None:
        assert flooder.stdout is not None
        buffer = b""
        async for chunk in flooder.stdout:
            buffer += chunk
            *complete, rest = buffer.split(b"\n")
            buffer = rest
            for raw in complete:
                line = raw.decode()
                lines.append(line)
                if line.startswith("READY "):
                    flooding.set()
                elif line.startswith(("PHASE ", "ERROR")):
                    done.set()
        await flooder.wait()
        flooding.set()
        done.set()

    honest_result: dict[str, Any] = {}

    async def work() -> None:
        # The honest peer is timed only while the flood runs: not while the
        # hostile process starts (imports, NIXL) or exits.
        await flooding.wait()
        sampler.take()
        honest_result.update(await honest.run(victim.node_id, done.is_set))
        honest_result["victim_rss_peak_mib"] = round(sampler.take() / 1024, 1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(work)
    ready = [line.split()[1] for line in lines if line.startswith("READY ")]
    phases = [json.loads(line[6:]) for line in lines if line.startswith("PHASE ")]
    errors = [line for line in lines if line.startswith("ERROR")]
    if flooder.returncode != 0 or not ready or not phases:
        raise SystemExit(f"the {kind} flood failed: {errors or lines[-5:]}")
    return {
        "hostile_peer": ready[0],
        "hostile": phases[0],
        "honest": honest_result,
        "victim_rss_peak_mib": honest_result.pop("victim_rss_peak_mib"),
    }


def pins_from_log(path: Path) -> dict[str, int]:
    """The most blocks each peer had pinned at once, recomputed from the event log."""
    held: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    jobs: dict[int, tuple[str, int]] = {}
    for event in read_log(path):
        if isinstance(event, ev.KeysPinned):
            peer = event.actor.peer
            jobs[event.job_id] = (peer, len(event.keys))
            held[peer] += len(event.keys)
            peak[peer] = max(peak[peer], held[peer])
        elif isinstance(event, ev.PinReleased) and event.job_id in jobs:
            peer, blocks = jobs.pop(event.job_id)
            held[peer] -= blocks
    return dict(peak)


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The whole benchmark: victim, baseline, the two flood phases; the raw figures."""
    victim = Victim(args, workdir)
    if not await trio.to_thread.run_sync(victim.ready.wait, 120):
        raise SystemExit("the victim did not start:\n" + "\n".join(victim.lines[-20:]))
    sampler = Sampler(victim)
    report: dict[str, Any] = {}
    try:
        pool = bytearray(args.blocks * args.block_len)
        cache = EmbeddedCache(args.blocks, args.block_len, memory=memoryview(pool))
        async with (
            open_zmq_transport("127.0.0.1:0", port=0) as control,
            open_nixl_transport(pool, args.block_len, name="honest") as data,
        ):
            config = NodeConfig(
                host="127.0.0.1",
                port=control.port,
                num_blocks=args.blocks,
                block_len=args.block_len,
                hash_seed=HASH_SEED,
            )
            async with open_node(config, control=control, data=data, parent=cache) as node:
                honest = Honest(node, cache, pool, args)
                report["honest_peer"] = node.node_id
                say(f"victim {victim.node_id} (pid {victim.proc.pid}), honest {node.node_id}")
                sampler.take()
                deadline = time.monotonic() + args.baseline
                baseline = await honest.run(
                    victim.node_id, lambda: time.monotonic() >= deadline, count=50
                )
                report["baseline"] = {
                    "honest": baseline,
                    "victim_rss_peak_mib": round(sampler.take() / 1024, 1),
                }
                say(f"baseline: {json.dumps(report['baseline'])}")
                for kind in PHASES:
                    report[kind] = await hostile_phase(args, victim, kind, honest, sampler)
                    say(f"{kind}: {json.dumps(report[kind])}")
                report["honest_failures"] = honest.failures[:10]
                # Let the last hostile session drain before the victim reports
                # (its requests end with it): it must hold nothing.
                await trio.sleep(args.settle)
    finally:
        sampler.close()
        report["victim_peak_rss_mib"] = round(victim.peak_kib() / 1024, 1)
        usage = victim.stop()
    report["victim_quota_usage"] = usage
    report["pins_from_log"] = pins_from_log(victim.log_path)
    report["log_mib"] = round(victim.log_path.stat().st_size / 2**20, 1)
    return report


def summary(report: dict[str, Any], quota: int) -> bool:
    """Print the figures; return whether every check held."""
    ok = True
    say()
    say(f"pinned-blocks quota per peer: {quota}")
    say(f"victim peak RSS (VmHWM): {report['victim_peak_rss_mib']} MiB")
    say(
        f"{'phase':<9} {'hostile/s':>9} {'pinned max':>10} {'(log)':>6} "
        f"{'lookup p50':>10} {'p99':>7} {'max':>7} {'fetch p50':>9} {'p99':>7} "
        f"{'verified':>8} {'RSS MiB':>8}"
    )
    for phase in ("baseline", *PHASES):
        data = report[phase]
        h = data["honest"]
        rate = pinned = logged = "-"
        if phase != "baseline":
            peer = data["hostile_peer"]
            usage = report["victim_quota_usage"].get(peer, {})
            pinned = usage.get("peak_pinned_blocks", 0)
            logged = report["pins_from_log"].get(peer, 0)
            rate = f"{data['hostile']['lookups_per_s']:.0f}"
            data["hostile_peak_pinned_blocks"] = pinned
            data["hostile_peak_pinned_blocks_from_log"] = logged
            data["hostile_refusals"] = usage.get("refusals", {})
            data["hostile_holds_at_end"] = {
                k: usage.get(k, 0)
                for k in ("pinned_blocks", "open_lookups", "fetch_rounds", "open_requests")
            }
            if max(pinned, logged) > quota or any(data["hostile_holds_at_end"].values()):
                ok = False
        say(
            f"{phase:<9} {rate:>9} {pinned!s:>10} {logged!s:>6} "
            f"{h['lookup_ms']['p50']:>10} {h['lookup_ms']['p99']:>7} {h['lookup_ms']['max']:>7} "
            f"{h['fetch_ms']['p50']:>9} {h['fetch_ms']['p99']:>7} "
            f"{h['blocks_verified']:>8} {data['victim_rss_peak_mib']:>8}"
        )
        if h["failures"]:
            ok = False
    for phase in PHASES:
        data = report[phase]
        held = data["hostile_holds_at_end"]
        say(f"{phase} refusals: {data['hostile_refusals']}; held once it left: {held}")
    honest_usage = report["victim_quota_usage"].get(report["honest_peer"], {})
    say(f"honest peer refusals: {honest_usage.get('refusals', {})}")
    if honest_usage.get("refusals"):
        ok = False
    say(f"event log: {report['log_mib']} MiB")
    if report["honest_failures"]:
        say(f"honest failures: {report['honest_failures']}")
    say("all checks held" if ok else "A CHECK FAILED")
    return ok


def main() -> None:
    """Run the benchmark; exit 1 if a check fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 hostile lookups per phase")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    parser.add_argument("--lookups", type=int, default=100_000, help="hostile lookups per phase")
    parser.add_argument("--keys", type=int, default=16, help="keys per hostile lookup")
    parser.add_argument("--window", type=int, default=256, help="hostile lookups unanswered")
    parser.add_argument("--blocks", type=int, default=4096, help="victim blocks (all preloaded)")
    parser.add_argument("--block-len", type=int, default=16384, help="bytes per block")
    parser.add_argument(
        "--pinned-quota", type=int, default=None, help="victim's per-peer pinned-blocks quota"
    )
    parser.add_argument("--baseline", type=float, default=20.0, help="seconds without flood")
    parser.add_argument("--pause", type=float, default=0.01, help="honest pause between requests")
    parser.add_argument(
        "--settle", type=float, default=10.0, help="seconds before the victim reports"
    )
    args = parser.parse_args()
    if args.quick:
        args.lookups = min(args.lookups, 5000)
        args.baseline = min(args.baseline, 5.0)
    quota = (
        args.pinned_quota
        if args.pinned_quota is not None
        else NodeConfig(num_blocks=args.blocks).quotas.pinned_blocks_limit(args.blocks)
    )
    say(
        f"flood: {args.lookups:,} hostile lookups per phase x {args.keys} keys, window "
        f"{args.window}; victim {args.blocks} blocks x {args.block_len} B, pinned quota {quota}"
    )
    with tempfile.TemporaryDirectory(prefix="p2pactor-flood-") as tmp:
        report = trio.run(run, args, Path(tmp))
    report["config"] = {
        k: v for k, v in vars(args).items() if k not in ("json",) and not callable(v)
    }
    report["pinned_quota"] = quota
    ok = summary(report, quota)
    report["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
