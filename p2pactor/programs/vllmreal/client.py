"""Driving a real vLLM engine process from this one: :class:`EngineProcess`.

The engine is :mod:`p2pactor.programs.vllmreal.engine` in a child process of its
own (it may start more: vLLM's engine core and worker, unless ``inproc``); its
log goes to a file. Every call waits for the engine's one answer, with a
timeout, and says what the engine last logged if it died.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import attrs

from p2pactor.programs.vllmreal.engine import PREFIX

__all__ = ["EngineError", "EngineOptions", "EngineProcess", "tier_entry"]


class EngineError(RuntimeError):
    """The engine process failed, or did not answer in time."""


def tier_entry(kind: str, port: int, **options: Any) -> dict[str, Any] | None:
    """An engine's ``secondary_tiers`` entry: ``ours``, ``stock`` (vLLM's ``p2p``) or ``none``."""
    if kind == "none":
        return None
    if kind == "ours":
        return {
            "type": "P2PActorTierManager",
            "module_path": "p2pactor.adapters.vllm",
            "host": "127.0.0.1",
            "port": port,
            **options,
        }
    if kind == "stock":
        return {"type": "p2p", "host": "127.0.0.1", "port": port, **options}
    raise ValueError(f"unknown tier {kind!r}: ours, stock or none")


@attrs.frozen(kw_only=True)
class EngineOptions:
    """One engine's configuration.

    Attributes:
        model: The model's folder (:func:`~p2pactor.programs.vllmreal.model.make_model`).
        engine_id: vLLM's engine id (it names the engine's offload region in /dev/shm).
        tier: Its ``secondary_tiers`` entry (:func:`tier_entry`), or None.
        cpu_bytes: Its CPU tier's bytes (``cpu_bytes_to_use``).
        block_size: Tokens per KV block (and per offloaded chunk).
        max_model_len: Longest prompt and output.
        max_num_seqs: Requests in a batch, at most.
        inproc: One process (vLLM's engine core and worker in it): faster to start.
    """

    model: str
    engine_id: str
    tier: dict[str, Any] | None = None
    cpu_bytes: int = 64 << 20
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 8
    inproc: bool = True


class EngineProcess:
    """A real vLLM engine in its own process.

    Args:
        options: What to build.
        log: Where the engine's own output goes.
        start_timeout: Seconds to wait for it to be ready.
    """

    def __init__(self, options: EngineOptions, log: Path, start_timeout: float = 600.0) -> None:
        self.options = options
        self.log = log
        self._log_file: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(  # noqa: S603 - our own module, our own options
            [
                sys.executable,
                "-m",
                "p2pactor.programs.vllmreal.engine",
                json.dumps(attrs.asdict(options)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            start_new_session=True,  # its own group: a stop reaches every process it started
        )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.ready = self._wait(start_timeout)
        except BaseException:
            self._kill()
            self._close()
            raise

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(PREFIX):
                self._answers.put(json.loads(line[len(PREFIX) :]))
        self._answers.put(None)  # it exited

    def _wait(self, timeout: float) -> dict[str, Any]:
        try:
            got = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(
                f"{self.options.engine_id}: no answer in {timeout:g} s{self._tail()}"
            ) from None
        if got is None:
            raise EngineError(
                f"{self.options.engine_id} exited ({self._proc.poll()}){self._tail()}"
            )
        if "error" in got:
            raise EngineError(f"{self.options.engine_id}: {got['error']}")
        return got

    def _tail(self) -> str:
        self._log_file.flush()
        text = self.log.read_text(errors="replace")[-4000:]
        return f"; its log ({self.log}) ends:\n{text}"

    def _call(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise EngineError(f"{self.options.engine_id} is gone{self._tail()}") from None
        return self._wait(timeout)

    def generate(
        self,
        prompts: list[list[int]],
        kv: list[dict[str, Any] | None] | None = None,
        max_tokens: int = 4,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        """Greedy outputs of ``prompts`` (each with its ``kv_transfer_params`` in ``kv``)."""
        kv = kv if kv is not None else [None] * len(prompts)
        return self._call(
            {"cmd": "generate", "prompts": prompts, "kv": kv, "max_tokens": max_tokens}, timeout
        )

    def metrics(self, timeout: float = 120.0) -> dict[str, float]:
        """VLLM's own figures now (``name{label=value}`` -> value)."""
        got: dict[str, float] = self._call({"cmd": "metrics"}, timeout)["metrics"]
        return got

    def stop(self, timeout: float = 120.0) -> list[str]:
        """Shut the engine down as vLLM does; the files of its own it left in /dev/shm."""
        left: list[str] = []
        try:
            if self._proc.poll() is None:
                left = list(self._call({"cmd": "quit"}, timeout)["left"])
                self._proc.wait(timeout=timeout)
        except (EngineError, subprocess.TimeoutExpired):
            self._kill()
            raise
        finally:
            self._kill()
            self._close()
        return left

    def _close(self) -> None:
        """Close the pipes and the log (the engine is gone)."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._reader.join(timeout=10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._log_file.close()

    def _kill(self) -> None:
        """End the engine's whole process group (after a normal exit: whatever it left)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc.poll() is None or not self._log_file.closed:
            try:
                self.stop()
            except EngineError:
                if exc is None:
                    raise
