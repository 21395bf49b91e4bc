"""The flood section's verdict on the honest peer's failures (``p2pactor/programs/bench/flood.py``).

Any MISS, failed fetch or wrong byte fails the section, except on vLLM's
producer when it stopped answering altogether: every failure a lost session,
and its ZeroMQ port accepting connections but never greeting them (vLLM 0.33.0
wedges its ZeroMQ I/O thread as a peer leaves; docs/reliability.md).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from p2pactor.programs.bench import flood


def _failed(failed: int, lost: int) -> dict[str, Any]:
    return {
        "lookups": 10,
        "failed": failed,
        "lost_session": lost,
        "failures": ["honest-3: 16 of 16 keys the producer holds answered MISS: ..."],
    }


@contextmanager
def _silent_port() -> Iterator[int]:
    """A port whose connections the kernel accepts but nobody greets: a stuck libzmq."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield int(listener.getsockname()[1])


@contextmanager
def _zmq_port() -> Iterator[int]:
    """A port a live ZeroMQ ROUTER listens on."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        yield router.bind_to_random_port("tcp://127.0.0.1")
    finally:
        router.close(linger=0)
        ctx.term()


@pytest.fixture(autouse=True)
def _quick_greeting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flood, "GREETING_S", 0.3)


def _check(side: str, port: int, result: dict[str, Any]) -> str | None:
    return flood._check(SimpleNamespace(side=side, port=port), "as the hostile peer left", result)  # type: ignore[arg-type]


def test_no_failure_passes() -> None:
    with _zmq_port() as port:
        assert _check("vllm", port, _failed(0, 0)) is None


def test_a_stuck_vllm_producer_is_noted_not_failed() -> None:
    with _silent_port() as port:
        note = _check("vllm", port, _failed(2, 2))
    assert note is not None
    assert "stopped answering" in note
    assert "honest-3" in note


def test_a_lost_session_to_a_vllm_producer_that_still_answers_fails() -> None:
    with _zmq_port() as port, pytest.raises(RuntimeError, match="2 honest request"):
        _check("vllm", port, _failed(2, 2))


def test_a_vllm_miss_that_is_not_a_lost_session_fails() -> None:
    with _silent_port() as port, pytest.raises(RuntimeError, match="2 honest request"):
        _check("vllm", port, _failed(2, 1))


def test_our_producer_is_never_excused() -> None:
    with _silent_port() as port, pytest.raises(RuntimeError, match="ours producer"):
        _check("ours", port, _failed(1, 1))
