"""Logs written by an earlier p2pactor still replay: the same timeline, the same verdict.

``tests/fixtures/log-v1/`` holds event logs written by p2pactor at commit 8ccef96,
before the event vocabulary was merged (issue 22), in the log format of that
time: the demo's two nodes (hits, misses, pending keys that resolve and one
that expires) and the replay tests' scenarios (aborts, timeouts, a lost
session, prefill/decode, two rounds, a rejected peer). Beside each pair is
what ``p2pactor replay --check`` printed for it then, as text and as JSON.
Reading them now must print exactly that: a debugger's old logs keep working.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from p2pactor.programs.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "log-v1"

PAIRS = {
    "demo": ("demo-0.p2plog", "demo-1.p2plog"),
    "scenarios": ("scenarios-a.p2plog", "scenarios-b.p2plog"),
}


def replay(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    # The fixtures' paths are relative, as they were when the outputs were taken.
    here = Path.cwd()
    os.chdir(FIXTURES)
    try:
        assert main(["replay", "--check", *args]) == 0
    finally:
        os.chdir(here)
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_an_old_log_replays_to_the_same_timeline(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = (FIXTURES / f"{name}.replay.txt").read_text()
    assert replay(capsys, *PAIRS[name]) == expected


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_an_old_log_gets_the_same_check_verdict_and_summary(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = json.loads((FIXTURES / f"{name}.replay.json").read_text())
    got = json.loads(replay(capsys, "--json", *PAIRS[name]))
    assert got == expected
    assert got["ok"] is True
    assert got["violations"] == []
