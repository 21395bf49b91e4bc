"""Replay refuses logs that cannot be the history of one actor, with one error type."""

from __future__ import annotations

import subprocess
import sys

import pytest
from msgspec.structs import replace

from p2pactor.core import events as ev
from p2pactor.core.fold import evolve, fold, initial_state
from p2pactor.core.ids import ActorId, Role
from p2pactor.errors import ReplayError

PRODUCER = ActorId(Role.PRODUCER, "10.0.0.2:5710", "req-1")
CONSUMER = ActorId(Role.CONSUMER, "10.0.0.2:5710", "req-1")


def resolved(seq: int, lookup_id: int) -> ev.KeysResolved:
    return ev.KeysResolved(
        actor=PRODUCER,
        seq=seq,
        at=1.0,
        lookup_id=lookup_id,
        hits=(),
        misses=(),
        pending=(),
        next_poll_at=None,
    )


def test_an_event_about_something_the_state_never_had_is_a_replay_error() -> None:
    with pytest.raises(ReplayError, match="KeysResolved #1 does not fit the state"):
        fold([resolved(1, lookup_id=5)])


def test_a_gap_in_the_sequence_is_a_replay_error() -> None:
    opened = ev.Opened(actor=CONSUMER, seq=1, at=0.0, round_seq=0)
    finish = ev.FinishRequested(actor=CONSUMER, seq=3, at=0.0)
    with pytest.raises(ReplayError, match="event seq 3 after seq 1"):
        fold([opened, finish])


def test_an_event_of_the_other_role_is_a_replay_error() -> None:
    with pytest.raises(ReplayError, match="KeysResolved is not a consumer event"):
        evolve(initial_state(CONSUMER), with_actor(resolved(1, 0), CONSUMER))


def test_an_event_of_another_actor_is_a_replay_error() -> None:
    other = ActorId(Role.PRODUCER, "10.0.0.3:5710", "req-1")
    with pytest.raises(ReplayError, match="applied to"):
        evolve(initial_state(other), resolved(1, 0))


def with_actor(event: ev.KeysResolved, actor: ActorId) -> ev.KeysResolved:
    return replace(event, actor=actor)


def test_a_dispatch_table_that_misses_a_type_is_refused_even_under_python_dash_o() -> None:
    code = "from p2pactor.core.builder import covers; covers({int: 0}, int | str)"
    argv = [sys.executable, "-O", "-c", code]
    run = subprocess.run(argv, check=False, capture_output=True, text=True)
    assert run.returncode == 1
    assert "P2PActorError: a dispatch table's types differ from its union's: ['str']" in run.stderr
