"""Helpers the bench sections share: subprocesses, ports, percentiles, what is installed."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here (a note), or None when it is importable."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not importable here (pip install vllm==0.33.0)"
    return None


def nixl_missing() -> str:
    """Why NIXL cannot be used here ('' when it can): the data sections need it."""
    from p2pactor.adapters.nixl import import_nixl  # noqa: PLC0415 - loads NIXL
    from p2pactor.errors import DataPlaneError  # noqa: PLC0415

    try:
        import_nixl()
    except DataPlaneError as exc:
        return f"NIXL is not installed: {exc}"
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (:func:`spread_ports`' one)."""
    return spread_ports(1, host)[0]


def spread_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` ports free on ``host`` now, below the ephemeral range (no source port)."""
    ports: list[int] = []
    rng = random.Random()  # noqa: S311 - spreads the ports, no secret
    while len(ports) < n:
        port = rng.randrange(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


@contextlib.asynccontextmanager
async def open_bench_node(
    port: int,
    pool: Any,
    block_len: int,
    *,
    name: str,
    parent: Any = None,
    host: str = "127.0.0.1",
    **config: Any,
) -> AsyncIterator[Any]:
    """A p2pactor node on ``host:port`` (0: any) over real ZeroMQ, and NIXL over ``pool``.

    ``config``: more :class:`~p2pactor.runtime.config.NodeConfig` fields; ``name``: NIXL's.
    """
    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415 - loads NIXL
    from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.node import open_node  # noqa: PLC0415

    async with (
        open_zmq_transport(f"{host}:{port}", port=port) as control,
        open_nixl_transport(pool, block_len, name=name) as data,
    ):
        bound = int(control.local_id.rsplit(":", 1)[1])
        blocks = len(pool) // block_len
        cfg = NodeConfig(host=host, port=bound, num_blocks=blocks, block_len=block_len, **config)
        async with open_node(cfg, control=control, data=data, parent=parent) as node:
            yield node


def offload_key(name: str) -> bytes:
    """A vLLM OffloadKey named ``name``: a 32-byte block hash (its sha256), the group index 0."""
    return hashlib.sha256(name.encode()).digest() + bytes(4)


def held(cache: Any) -> dict[str, int]:
    """What an :class:`~p2pactor.runtime.parent.EmbeddedCache` still holds (all 0 when idle)."""
    return {
        "pinned": cache.pinned(),
        "held_jobs": len(cache.held_jobs()),
        "open": len(cache.opened),
    }


def say(obj: Any) -> None:
    """Report one line to the parent process at once: ``obj`` itself if a str, else its JSON."""
    sys.stdout.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    sys.stdout.flush()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


def memory_kib(pid: int | str = "self") -> tuple[int, int]:
    """Process ``pid``'s ``(VmRSS, VmHWM)`` (its peak) in KiB; ``(0, 0)`` once it is gone."""
    got = {"VmRSS:": 0, "VmHWM:": 0}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for fields in map(str.split, status):
            if fields and fields[0] in got:
                got[fields[0]] = int(fields[1])
    return got["VmRSS:"], got["VmHWM:"]


class ChildError(RuntimeError):
    """A helper process failed, exited or hung; the message says where to look."""


class LineProcess:
    """A helper process (``python -m module args``) spoken to by lines, the bench's one protocol.

    It says ``READY`` once set up; a command is a JSON line on its stdin, answered by a JSON
    line (other lines skipped); ``WORD rest`` lines can be waited for (``ERROR ...`` raises);
    closing its stdin stops it (a last JSON line may follow). A thread queues its stdout, so
    every read can time out; its stderr goes to a file (the errors quote its tail) or nowhere.
    """

    def __init__(
        self, module: str, *args: str, stderr: str | None = None, host: Any = None, **env: str
    ) -> None:
        """Start it (on ``host``, a :class:`~p2pactor.programs.hosts.Host`, else here).

        ``stderr``: a file for its stderr (else dropped); ``env``: extra variables.
        """
        self.module = module
        self.stderr = stderr
        argv = [sys.executable, "-m", module, *args]
        environ = {"NIXL_LOG_LEVEL": "WARN"} | dict(os.environ) | env
        err = open(stderr, "w") if stderr else subprocess.DEVNULL  # noqa: SIM115 - the child's
        try:
            self.proc = subprocess.Popen(  # noqa: S603 - runs our own helper module
                host.command(argv) if host else argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=host.env(environ) if host else environ,
            )
        finally:
            if not isinstance(err, int):
                err.close()  # the child has its own copy
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def why(self) -> str:
        """What its stderr ends with (for an error message)."""
        try:
            with open(self.stderr or "", errors="replace") as f:
                return f.read()[-2000:].strip()
        except OSError:
            return ""

    def line(self, timeout: float | None = None) -> str:
        """Its next line of output; raise :class:`ChildError` if it exited or hung."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise ChildError(
                f"{self.module} (pid {self.pid}) said nothing in {timeout:g} s; "
                f"its stderr: {self.stderr}"
            ) from None
        if line is None:
            self._lines.put(None)
            raise ChildError(
                f"{self.module} (pid {self.pid}) exited with {self.proc.wait()}: {self.why()}"
            )
        return line

    def expect(self, *words: str, timeout: float | None = None) -> tuple[str, Any]:
        """The next line starting with one of ``words``: ``(word, its JSON or text)``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            word, _, rest = self.line(left).partition(" ")
            if word == "ERROR":
                raise ChildError(f"{self.module} (pid {self.pid}) failed: {rest}")
            if word in words:
                return word, json.loads(rest) if rest.startswith("{") else rest

    def wait_ready(self, timeout: float | None = None) -> Any:
        """Wait for its ``READY``; what it said after the word."""
        return self.expect("READY", timeout=timeout)[1]

    def send(self, cmd: dict[str, Any] | str) -> None:
        """Send one command (JSON, or a line as it is)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((cmd if isinstance(cmd, str) else json.dumps(cmd)) + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send one command; its answer, the next JSON line it says."""
        self.send(cmd)
        while not (line := self.line(timeout)).startswith("{"):
            pass
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self, timeout: float = 30) -> dict[str, Any]:
        """Close its stdin and wait; its last JSON line (a producer's counters), if any."""
        with contextlib.suppress(BrokenPipeError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return {}
        self._reader.join(timeout=10)
        last: dict[str, Any] = {}
        while (line := self._lines.get()) is not None:
            if line.startswith("{"):
                last = json.loads(line)
        self._lines.put(None)
        return last

    def pause(self, *, paused: bool) -> None:
        """Stop it (SIGSTOP) or let it go on (SIGCONT), while it runs."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def kill(self) -> None:
        """Kill it if it still runs (after a failure), reap it, close its pipes."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)  # a stopped process dies only once continued
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


def child_result(module: str, *args: str, timeout: float, **options: Any) -> Any:
    """The JSON of the ``RESULT {json}`` line a fresh :class:`LineProcess` says; killed after."""
    child = LineProcess(module, *args, **options)
    try:
        return child.expect("RESULT", timeout=timeout)[1]
    finally:
        child.kill()


def take_turns(rep: int, sides: Mapping[str, Sequence[LineProcess]]) -> Iterator[str]:
    """Each side's name in turn (reversed every other ``rep``), its processes alone running.

    The others are stopped (SIGSTOP): two idle vLLM processes' spinning NIXL threads took
    half of two cores. A turn lasts seconds, well inside the 10 s heartbeat timeout.
    """
    for side in list(sides) if rep % 2 == 0 else list(sides)[::-1]:
        for other, procs in sides.items():
            for proc in procs:
                proc.pause(paused=other != side)
        time.sleep(0.05)  # let them catch up with their sockets before measuring
        yield side
