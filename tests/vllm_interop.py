"""Drive vLLM secondary tiers hosted in their own processes (``tests/vllm_tier_host.py``).

A test opens one host per engine and drives each like vLLM's scheduler::

    with open_tier_hosts(
        HostSpec(STOCK, port=p1), HostSpec(STOCK, port=p2), log_dir=tmp_path
    ) as (a, b):
        b.store(keys)
        a.new_request("r1", a.source_params(b, "kv-1"))  # a pulls from b
        answers = a.lookup_until("r1", keys)["results"]   # ["HIT", ...]
        job = a.submit_load("r1", keys)
        assert a.wait_job(job)["success"]
        assert all(a.verify(keys))
        a.finish("r1")

The client is synchronous (one command at a time per host, answered within its
timeout) and thread-safe per host. Every host also runs vLLM's tier-poll thread
unless ``poll_interval_s=0``, so a producer serves its peers while the test
drives only the consumer. Methods mirror the host's commands, documented at the
top of ``tests/vllm_tier_host.py``; keys are ``bytes`` here and hex on the wire.

Each host's stderr (vLLM, NIXL and UCX logs, tracebacks) goes to
``<log_dir>/<name>.log``; errors quote its tail. ``TierHost.kill`` SIGKILLs a
host (``TierHost.signal`` sends any signal without waiting, e.g. SIGSTOP);
:class:`HostPool` starts many hosts side by side (their vLLM imports overlap)
for tests to share, restarting one that was killed. ``HostSpec(on=host)`` runs a
tier host on a namespaced host of ``p2pactor.programs.hosts`` (its address, its
network; ``tests/test_hosts_vllm.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tests.ports import free_port

if TYPE_CHECKING:
    from p2pactor.programs.hosts import Host

HOST_SCRIPT = Path(__file__).with_name("vllm_tier_host.py")
PREFIX = "@host "
STOCK = "p2p"  # vLLM's own P2PSecondaryTierManager, by its registered type
OURS = "p2pactor.adapters.vllm:P2PActorTierManager"

T = TypeVar("T")


def vllm_p2p_missing() -> str | None:
    """Why vLLM 0.33's P2P tier cannot be hosted here, or None when it can (a skip reason)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not any(
        (Path(p) / "v1/kv_offload/tiering/p2p/manager.py").exists()
        for p in spec.submodule_search_locations or ()
    ):
        return "vLLM 0.33 with its P2P tier is not installed (pip install --no-deps vllm==0.33.0)"
    return None


class HostError(Exception):
    """A tier host failed."""


class HostDied(HostError):
    """The host process exited (or never answered)."""


class HostCommandError(HostError):
    """A command failed in the host; ``kind`` is the host's classification."""

    def __init__(self, kind: str, message: str, tb: str | None = None) -> None:
        super().__init__(f"{kind}: {message}" + (f"\n{tb}" if tb else ""))
        self.kind = kind
        self.message = message
        self.traceback = tb


class TierImportError(HostCommandError):
    """The tier class could not be imported in the host; ``tier`` names it."""

    tier = ""


def make_key(label: str | int, group: int = 0) -> bytes:
    """An offload key: a 32-byte block hash plus a 4-byte big-endian group index."""
    return hashlib.sha256(str(label).encode()).digest() + group.to_bytes(4, "big")


def make_keys(prefix: str, n: int, group: int = 0) -> list[bytes]:
    return [make_key(f"{prefix}-{i}", group) for i in range(n)]


def contents(key: bytes, chunk_bytes: int) -> bytes:
    """What a host's ``store`` writes for ``key`` (and what ``verify`` expects)."""
    return random.Random(key).randbytes(chunk_bytes)


def expected_digest(key: bytes, chunk_bytes: int) -> str:
    return hashlib.sha256(contents(key, chunk_bytes)).hexdigest()


@dataclass
class HostSpec:
    """How to start one host: the tier class and its configuration.

    ``tier`` is a registered vLLM tier type (``"p2p"``) or ``"module:Class"``.
    ``kwargs`` are extra tier kwargs (beside ``host`` and ``port``); ``spec``
    overrides the OffloadingSpec fields (model, dtype, num_layers, ...);
    ``env`` adds environment variables (``VLLM_P2P_*`` ...). ``hash_seed`` becomes
    PYTHONHASHSEED (None: unset, vLLM then uses ``vllm-none-hash``). ``on`` runs
    the process on a namespaced host (``p2pactor.programs.hosts``): its command
    is ``on.command(...)``, its environment ``on.env(...)`` (UCX over TCP on the
    host's interface), and the tier binds and advertises ``on.address``
    instead of ``host``.
    """

    tier: str = STOCK
    host: str = "127.0.0.1"
    port: int | None = None
    num_chunks: int = 64
    chunk_bytes: int = 65536
    hash_seed: str | None = "0"
    hash_algo: str = "sha256"
    poll_interval_s: float = 0.001
    log_level: str = "INFO"
    kwargs: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    on: Host | None = None

    @property
    def address(self) -> str:
        """The address the tier binds and peers dial: ``on.address`` or ``host``."""
        return self.on.address if self.on is not None else self.host

    def init_command(self, port: int) -> dict[str, Any]:
        return {
            "cmd": "init",
            "tier": self.tier,
            "kwargs": {"host": self.address, "port": port, **self.kwargs},
            "num_chunks": self.num_chunks,
            "chunk_bytes": self.chunk_bytes,
            "hash_seed": self.hash_seed,
            "hash_algo": self.hash_algo,
            "poll_interval_s": self.poll_interval_s,
            "log_level": self.log_level,
            "spec": self.spec,
        }


class TierHost:
    """One running host process and its command channel."""

    def __init__(self, spec: HostSpec, log_dir: Path, log_name: str | None = None) -> None:
        self.spec = spec
        if spec.port is not None:
            self.port = spec.port
        else:  # any port is free in a fresh namespace; pick one from here
            self.port = free_port(spec.host if spec.on is None else "127.0.0.1")
        self.name = spec.name or f"tier-{self.port}"
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_dir) / f"{log_name or self.name}.log"
        self.info: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        env = dict(os.environ)
        env["NIXL_LOG_LEVEL"] = "WARN"
        env["PYTHONUNBUFFERED"] = "1"
        if spec.hash_seed is None:
            env.pop("PYTHONHASHSEED", None)
        else:
            env["PYTHONHASHSEED"] = spec.hash_seed
        env.update(spec.env)
        argv = [sys.executable, str(HOST_SCRIPT)]
        if spec.on is not None:
            argv, env = spec.on.command(argv), spec.on.env(env)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                encoding="utf-8",
            )
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self._reader.start()
        self._init_id = self._send(spec.init_command(self.port))

    # -- plumbing ------------------------------------------------------------------

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._answers.put(json.loads(line[len(PREFIX) :]))
        self._answers.put(None)

    def _send(self, msg: dict[str, Any]) -> int:
        msg_id = next(self._ids)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({**msg, "id": msg_id}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise HostDied(f"{self.name}: cannot send ({exc}){self.log_tail()}") from exc
        return msg_id

    def _receive(self, msg_id: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                answer = self._answers.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise HostError(
                    f"{self.name}: no answer within {timeout}s{self.log_tail()}"
                ) from None
            if answer is None:
                self._answers.put(None)
                raise HostDied(f"{self.name}: exited ({self.proc.poll()}){self.log_tail()}")
            if answer.get("id") != msg_id:
                continue  # the late answer of a command that timed out
            if answer["ok"]:
                return answer["result"]
            cls = TierImportError if answer["kind"] == "tier_import" else HostCommandError
            raise cls(answer["kind"], answer["error"], answer.get("traceback"))

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        """Wait for ``init`` (imports vLLM, builds the tier): the host's info."""
        with self._lock:
            try:
                self.info = self._receive(self._init_id, timeout)
            except TierImportError as exc:
                exc.tier = self.spec.tier
                raise
        return self.info

    def call(self, cmd: str, reply_timeout: float = 30.0, **args: Any) -> Any:
        """Run one host command and return its result (``args`` are the command's)."""
        with self._lock:
            return self._receive(self._send({"cmd": cmd, **args}), reply_timeout)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(text)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def local_id(self) -> str:
        """``host:port`` as the tier is known to peers."""
        return str(self.info.get("local_id", f"{self.spec.address}:{self.port}"))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the process now (no shutdown, sockets torn down by the kernel)."""
        if self.alive:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=10)

    def signal(self, sig: int) -> None:
        """Send ``sig`` without waiting (``SIGSTOP`` freezes the host, sockets open)."""
        if self.alive:
            self.proc.send_signal(sig)

    def begin_close(self) -> None:
        """End of input: the host shuts its tier down and exits (see ``close``)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with suppress(BrokenPipeError, OSError):
                self.proc.stdin.close()

    def close(self, timeout: float = 15.0) -> None:
        """End of input, then wait for the exit; kill the host if it hangs."""
        self.begin_close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    # -- request parameters --------------------------------------------------------

    def source_params(self, producer: TierHost, kv_request_id: str) -> dict[str, Any]:
        """``kv_transfer_params`` of a symmetric consumer pulling from ``producer``."""
        return source_params(producer, kv_request_id)

    # -- engine side ---------------------------------------------------------------

    def new_request(self, req: str, params: dict[str, Any] | None = None) -> str:
        return str(self.call("new_request", req=req, params=params))

    def lookup(self, req: str, keys: Iterable[bytes]) -> list[str]:
        return list(self.call("lookup", req=req, keys=_hex(keys)))

    def lookup_until(
        self, req: str, keys: Iterable[bytes], timeout: float = 10.0
    ) -> dict[str, Any]:
        """Lookup then step until no key answers RETRY: ``results``, ``elapsed_s``, ``steps``."""
        out: dict[str, Any] = self.call(
            "lookup_until", reply_timeout=timeout + 10, req=req, keys=_hex(keys), timeout=timeout
        )
        return out

    def submit_load(self, req: str, keys: Iterable[bytes]) -> int:
        return int(self.call("submit_load", req=req, keys=_hex(keys))["job_id"])

    def submit_store(self, req: str, keys: Iterable[bytes]) -> int:
        return int(self.call("submit_store", req=req, keys=_hex(keys))["job_id"])

    def finish(self, req: str) -> None:
        self.call("finish", req=req)

    def step(self, n: int = 1, sleep_s: float = 0.001) -> list[dict[str, Any]]:
        """``n`` engine steps; the job results reported since the last step."""
        return list(self.call("step", n=n, sleep_s=sleep_s)["finished"])

    def wait_jobs(self, job_ids: Sequence[int], timeout: float = 10.0) -> dict[int, Any]:
        out = self.call(
            "wait_jobs", reply_timeout=timeout + 10, job_ids=list(job_ids), timeout=timeout
        )
        return {int(k): v for k, v in out["results"].items()}

    def wait_job(self, job_id: int, timeout: float = 10.0) -> dict[str, Any]:
        result: dict[str, Any] = self.wait_jobs([job_id], timeout)[job_id]
        return result

    def has_pending_work(self) -> bool:
        return bool(self.call("has_pending_work"))

    def shutdown(self) -> dict[str, Any]:
        out: dict[str, Any] = self.call("shutdown", reply_timeout=30)
        return out

    # -- cache side ----------------------------------------------------------------

    def store(self, keys: Iterable[bytes]) -> list[int]:
        return list(self.call("store", keys=_hex(keys)))

    def mark_pending(self, keys: Iterable[bytes]) -> None:
        self.call("mark_pending", keys=_hex(keys))

    def mark_retry(self, keys: Iterable[bytes]) -> None:
        self.call("mark_retry", keys=_hex(keys))

    def evict(self, keys: Iterable[bytes]) -> list[str]:
        return list(self.call("evict", keys=_hex(keys)))

    def read(self, keys: Iterable[bytes]) -> list[str | None]:
        return list(self.call("read", keys=_hex(keys)))

    def verify(self, keys: Iterable[bytes]) -> list[bool]:
        return list(self.call("verify", keys=_hex(keys)))

    def load_state(self, job_id: int, exact: bool = False) -> dict[str, Any]:
        """How far a load's writes got: ``chunks``, ``touched``, ``exact``, ``result``."""
        out: dict[str, Any] = self.call("load_state", job_id=job_id, exact=exact)
        return out

    # -- checks ----------------------------------------------------------------------

    def parent_report(self, calls: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = self.call("parent_report", calls=calls)
        return out

    def calls(self, since: int = 0) -> list[dict[str, Any]]:
        return list(self.call("calls", since=since))

    def wait_quiet(self, timeout: float = 10.0) -> dict[str, Any]:
        """Step until the parent has no open context, pin or load: the report, with ``quiet``."""
        out: dict[str, Any] = self.call("wait_quiet", reply_timeout=timeout + 10, timeout=timeout)
        return out

    def clock(self) -> float:
        """The host's time now, on the clock of its ``calls`` records."""
        return float(self.call("clock"))

    def on_one_clock(self, t: float) -> float:
        """The host's time ``t`` on ``time.monotonic``, which every host of a machine shares."""
        return float(self.info["clock_origin"]) + t

    def producer_events(self, kv_request_id: str) -> list[dict[str, Any]] | None:
        """A p2pactor tier's producer events for ``kv_request_id``; None for others."""
        out: list[dict[str, Any]] | None = self.call("producer_events", kv_request_id=kv_request_id)
        return out

    def closed_sessions(self) -> list[dict[str, Any]] | None:
        """A p2pactor tier's closed sessions (``peer_id``, ``reason``, ...); None for others."""
        out: list[dict[str, Any]] | None = self.call("closed_sessions")
        return out

    def log_text(self) -> str:
        """Everything the host has logged so far (vLLM, NIXL, UCX, p2pactor)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def selftest(self) -> dict[str, Any]:
        out: dict[str, Any] = self.call("selftest")
        return out

    def until(
        self,
        predicate: Callable[[], T],
        timeout: float = 10.0,
        step: bool = True,
        interval: float = 0.001,
    ) -> T:
        """Evaluate ``predicate`` (which may call this host) and step until it is truthy."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: condition not met within {timeout}s")
            if step:
                self.step(1, sleep_s=0)
            time.sleep(interval)


def _role(producer: TierHost, kv_request_id: str) -> dict[str, Any]:
    host, _, port = producer.local_id.rpartition(":")
    return {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": int(port)}


def source_params(producer: TierHost, kv_request_id: str) -> dict[str, Any]:
    """A symmetric-P2P consumer's ``kv_transfer_params``: probe ``producer``, then pull."""
    return {"remote_kv_source": _role(producer, kv_request_id)}


def prefiller_params(producer: TierHost, kv_request_id: str) -> dict[str, Any]:
    """A prefill/decode consumer's (the decoder's): every key is a HIT on ``producer``."""
    return {"remote_prefiller": _role(producer, kv_request_id)}


def decoder_params(kv_request_id: str) -> dict[str, Any]:
    """A prefill/decode producer's (the prefiller's): stores wait for the decoder's fetch."""
    return {"remote_decoder": {"kv_request_id": kv_request_id}}


def _hex(keys: Iterable[bytes]) -> list[str]:
    return [bytes(k).hex() for k in keys]


@contextmanager
def open_tier_hosts(
    *specs: HostSpec, log_dir: str | os.PathLike[str] | None = None, timeout: float = 120.0
) -> Iterator[list[TierHost]]:
    """Start hosts side by side (their imports overlap), wait until all are ready.

    On exit each host gets end of input (it shuts its tier down and exits), or
    is killed after a grace period. A :class:`TierImportError` from any host is
    raised after the others are closed.
    """
    directory = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="tier-"))
    hosts: list[TierHost] = []
    try:
        hosts.extend(TierHost(spec, directory) for spec in specs)
        for h in hosts:
            h.wait_ready(timeout)
        yield hosts
    finally:
        for h in hosts:
            h.begin_close()
        for h in hosts:
            h.close()


class HostPool:
    """Hosts started side by side and shared by many tests, by name.

    ``start`` spawns every host first and then waits for each, so their imports
    of vLLM (seconds each) overlap. A host whose tier class does not import is
    closed and its tier recorded in ``unimportable``; any other failure closes
    the whole pool and is raised. ``pool[name]`` restarts a host that died (a
    test killed it) from the same spec, on a fresh port.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None) -> None:
        self.log_dir = (
            Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="tier-"))
        )
        self.hosts: dict[str, TierHost] = {}
        self.specs: dict[str, HostSpec] = {}
        self.unimportable: dict[str, str] = {}
        self._restarts = itertools.count(1)

    def start(self, specs: Iterable[HostSpec], timeout: float = 120.0) -> None:
        fresh: list[TierHost] = []
        try:
            for spec in specs:
                if spec.tier in self.unimportable:
                    continue
                host = TierHost(spec, self.log_dir)
                fresh.append(host)
                self.hosts[host.name] = host
                self.specs[host.name] = spec
            for host in fresh:
                try:
                    host.wait_ready(timeout)
                except TierImportError as exc:
                    self.unimportable[exc.tier] = exc.message
                    del self.hosts[host.name]
                    host.close()
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> TierHost:
        host = self.hosts[name]
        if not host.alive:
            host.close()
            spec = self.specs[name]
            log_name = f"{name}.restart{next(self._restarts)}"
            host = TierHost(replace(spec, port=None, name=name), self.log_dir, log_name)
            self.hosts[name] = host
            host.wait_ready()
        return host

    def close(self) -> None:
        hosts, self.hosts = list(self.hosts.values()), {}
        for host in hosts:
            host.begin_close()
        for host in hosts:
            host.close()


@contextmanager
def open_tier_host(
    tier: str = STOCK, log_dir: str | os.PathLike[str] | None = None, **options: Any
) -> Iterator[TierHost]:
    """One host; ``options`` are :class:`HostSpec` fields."""
    with open_tier_hosts(HostSpec(tier=tier, **options), log_dir=log_dir) as (host,):
        yield host
