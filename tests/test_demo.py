"""The main job end to end: ``p2pactor demo`` with real processes, ZeroMQ and NIXL.

A small run (2 nodes, 3 requests each, 4 KiB blocks) must verify every byte,
print its summary and the replay command, and that command must pass ``--check``
on the logs it wrote; by default every request finds its source by itself,
and with ``--named`` each names it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from p2pactor.programs.demo.workload import DemoPlan, Expect, requests_of


@pytest.mark.parametrize("named", [False, True], ids=["found-by-summaries", "named"])
def test_a_small_demo_verifies_every_byte_and_its_logs_replay(tmp_path: Path, named: bool) -> None:
    logs = tmp_path / "logs"
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pactor",
            "demo",
            "--nodes",
            "2",
            "--requests",
            "3",
            "--block-size",
            "4096",
            "--log-dir",
            str(logs),
            "--timeout",
            "90",
            *(["--named"] if named else []),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "Demo OK: every fetched byte verified" in out
    plan = DemoPlan(nodes=2, requests=3, block_len=4096)
    expected = sum(r.hit_prefix() for r in requests_of(plan))
    assert f"{expected} of {expected} fetched blocks verified byte for byte" in out
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert total.split()[1:3] == ["6", str(6 * plan.request_blocks)]
    setup = next(line for line in out.splitlines() if line.startswith("Setup:"))
    assert ("read their summaries" in setup) is not named
    sources = [line for line in out.splitlines() if line.startswith("Sources:")]
    if named:
        assert sources == []
    else:  # every request found, by itself, the peer that served its conversation
        found = (
            "Sources: no request named one; 6 of 6 found the peer that served their "
            f"conversation in the peers' summaries ({expected} hits), with no router."
        )
        assert sources == [found]
    replay_line = next(line for line in out.splitlines() if line.startswith("Inspect them:"))
    command = shlex.split(replay_line.removeprefix("Inspect them: "))
    start = command.index("replay")
    assert command[start : start + 2] == ["replay", "--check"]
    assert Path(command[0]).name in {"p2pactor", Path(sys.executable).name}
    checked = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "check: no violations" in checked.stdout
    assert sorted(p.name for p in logs.glob("*.p2plog")) == ["node-0.p2plog", "node-1.p2plog"]


def test_the_workload_has_every_kind_of_answer() -> None:
    plan = DemoPlan()
    expects = {e for r in requests_of(plan) for e in r.expect}
    assert expects == set(Expect)
    # every request follows up a conversation another node served
    assert all(r.producer != r.consumer for r in requests_of(plan))


@pytest.mark.parametrize("field", ["nodes", "requests", "block_len"])
def test_a_nonsense_plan_is_refused(field: str) -> None:
    from p2pactor.errors import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=field):
        DemoPlan(**{field: 0})
