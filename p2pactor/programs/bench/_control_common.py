"""Helpers the bench sections share: subprocesses, ports, percentiles, what is installed."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "TIER_METHODS",
    "LineProcess",
    "child_env",
    "free_port",
    "module_command",
    "nixl_missing",
    "peak_rss_kib",
    "percentile",
    "process_cpu_s",
    "ratio_or_none",
    "run_module",
    "say",
    "thread_cpu_ns",
    "vllm_missing",
]

TIER_METHODS = (
    "has_pending_work",
    "on_new_request",
    "get_finished_jobs",
    "lookup",
    "serve_external_requests",
    "submit_load",
    "on_schedule_end",
    "on_request_finished",
)
"""The tier methods the engine section times on the engine's thread, in report order."""


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here (a note), or None when it is importable."""
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "vLLM is not importable here (pip install vllm==0.33.0)"


def module_command(module: str, *args: str) -> list[str]:
    """The command line running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a helper process, with NIXL quiet and ``extra`` set."""
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.update(extra)
    return env


def run_module(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args`` to the end; raise with its output's tail if it fails."""
    done = subprocess.run(  # noqa: S603 - runs our own helper module
        module_command(module, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stdout[-1500:] + "\n" + done.stderr[-3000:]).strip()
        raise RuntimeError(f"{module} exited with {done.returncode}:\n{tail}")
    return done


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
    """A TCP port that is free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


def ratio_or_none(ours: float, theirs: float) -> float | None:
    """``ours / theirs`` when both are finite and ``theirs`` is not 0, else None."""
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs == 0:
        return None
    return ours / theirs


def peak_rss_kib() -> int:
    """This process's peak resident memory in KiB (VmHWM), 0 where /proc has none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process ``pid`` so far; 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces: the fields start after its ")".
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_cpu_ns(pid: int) -> dict[int, tuple[str, int]]:
    """Each live thread of process ``pid``: its name and CPU nanoseconds so far (schedstat).

    Finer than :func:`process_cpu_s` (clock ticks), but a thread that exits
    takes its time with it: for processes whose threads live on (idle ones).
    """
    out: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, IndexError, ValueError):
            continue  # it just exited
        out[int(tid)] = (name, ns)
    return out


class LineProcess:
    """A helper process (``python -m module args``) spoken to by lines of JSON.

    It says ``READY`` when it is set up; each command is one JSON line on its
    stdin and gets one JSON line back on its stdout (other lines, a library's
    logging say, are skipped); closing its stdin stops it, and it may print
    one last JSON line then.
    """

    def __init__(self, module: str, *args: str, stderr: str | None = None, **env: str) -> None:
        """Start it; ``stderr``: a file for its stderr (else dropped); ``env``: extra variables."""
        self.module = module
        self.stderr = stderr
        err = open(stderr, "w") if stderr else subprocess.DEVNULL  # noqa: SIM115 - the child's
        try:
            self.proc = subprocess.Popen(  # noqa: S603 - runs our own helper module
                module_command(module, *args),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=child_env(**env),
            )
        finally:
            if not isinstance(err, int):
                err.close()  # the child has its own copy
        self.pid = self.proc.pid

    def _why(self) -> str:
        tail = ""
        if self.stderr:
            try:
                with open(self.stderr) as f:
                    tail = f.read()[-2000:].strip()
            except OSError:
                pass
        return f"{self.module} (pid {self.pid}) exited with {self.proc.wait()}" + (
            f":\n{tail}" if tail else ""
        )

    def line(self) -> str:
        """Its next line of output; raise if it exited."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(self._why())
        return line.strip()

    def wait_ready(self) -> None:
        """Wait for its ``READY``."""
        while self.line() != "READY":
            pass

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send one command; its JSON answer."""
        self.send(cmd)
        return self.answer()

    def send(self, cmd: dict[str, Any]) -> None:
        """Send one command (its answer: :meth:`answer`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        """The next JSON line it says."""
        while True:
            line = self.line()
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                return answer

    def close(self) -> dict[str, Any]:
        """Close its stdin and wait; its last JSON line (a producer's counters), if any."""
        try:
            out, _ = self.proc.communicate(input="", timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return {}
        except (BrokenPipeError, ValueError):
            return {}
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                return result
        return {}

    def pause(self, *, paused: bool) -> None:
        """Stop it (SIGSTOP) or let it go on (SIGCONT), while it runs."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def kill(self) -> None:
        """Kill it if it still runs (after a failure), and reap it."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)  # a stopped process dies only once continued
            self.proc.kill()
            self.proc.wait()
