"""The slow-step watch on the node's trio thread: ``LoopWatch``, ``/status``'s ``loop``, metrics.

* Unit, in a bare trio run on a clock the test moves: a step that "takes" a
  second is recorded with its task's name, steps that take no time are not,
  the ring keeps the last 32 newest first, the log is rate-limited, and the
  watch counts nothing before it starts or after it stops.
* A real node (in-memory transports): a task that blocks its thread with
  ``time.sleep`` is recorded, at least as long as it slept, under its name;
  ``/status``, ``/metrics`` and ``p2pactor status`` carry it; the node removes
  the watch when it closes.
* Configuration: the default, ``P2PACTOR_SLOW_STEP_MS``, ``serve --slow-step-ms``.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any

import pytest
import trio

from p2pactor.errors import ConfigError
from p2pactor.programs.cli import build_parser
from p2pactor.programs.serve import config_from_args
from p2pactor.programs.status_cli import format_status
from p2pactor.runtime.config import SLOW_STEP_S, NodeConfig
from p2pactor.runtime.loopwatch import RECENT_SLOW, LoopWatch
from tests.cluster import open_cluster
from tests.test_metrics import samples, value


class Clock:
    """A step clock the test moves: a step lasts what its task adds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def spin(steps: int) -> None:
    """Steps that take no time on the test's clock."""
    for _ in range(steps):
        await trio.lowlevel.checkpoint()


async def start(watch: LoopWatch) -> None:
    """Start ``watch``, and begin a step it times (it skips the one it started in)."""
    watch.start()
    await trio.lowlevel.checkpoint()


async def stall(clock: Clock, seconds: float, times: int = 1) -> None:
    """``times`` steps of ``seconds`` each on the test's clock."""
    for _ in range(times):
        clock.now += seconds
        await trio.lowlevel.checkpoint()


async def test_a_long_step_is_recorded_with_its_task_and_quick_ones_are_not() -> None:
    clock = Clock()
    watch = LoopWatch(0.05, node_id="n:1", clock=clock)
    watch.start()
    before = time.time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spin, 100, name="quick")
        nursery.start_soon(stall, clock, 1.5, name="stalls")
    watch.stop()
    seen = watch.snapshot()
    assert seen.slow_step_s == 0.05
    assert seen.steps > 100
    assert seen.slow_steps == 1
    assert seen.longest_step_s == 1.5
    (step,) = seen.recent_slow
    assert (step.task, step.seconds) == ("stalls", 1.5)
    assert before <= step.at <= time.time()


async def test_the_step_running_when_the_watch_starts_is_not_counted() -> None:
    clock = Clock()
    watch = LoopWatch(0.05, clock=clock)
    watch.start()
    clock.now += 10.0  # the rest of this step: it began before the watch did
    await trio.lowlevel.checkpoint()
    watch.stop()
    assert watch.snapshot().slow_steps == 0
    assert watch.snapshot().longest_step_s == 0.0


async def test_the_longest_step_counts_steps_under_the_threshold_too() -> None:
    clock = Clock()
    watch = LoopWatch(5.0, clock=clock)
    await start(watch)
    await stall(clock, 0.25)
    await stall(clock, 0.5)
    await stall(clock, 0.125)
    watch.stop()
    seen = watch.snapshot()
    assert (seen.slow_steps, seen.longest_step_s, seen.recent_slow) == (0, 0.5, ())


async def test_the_ring_keeps_the_most_recent_slow_steps_newest_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    watch = LoopWatch(0.05, node_id="n:1", clock=clock)
    await start(watch)
    with caplog.at_level(logging.WARNING, logger="p2pactor.loopwatch"):
        for i in range(1, 41):
            await stall(clock, float(i))
    watch.stop()
    seen = watch.snapshot()
    assert seen.slow_steps == 40
    assert len(seen.recent_slow) == RECENT_SLOW == 32
    assert [s.seconds for s in seen.recent_slow] == [float(i) for i in range(40, 8, -1)]
    assert seen.longest_step_s == 40.0
    # the first ten are logged, then one in a hundred
    lines = [r for r in caplog.records if r.name == "p2pactor.loopwatch"]
    assert len(lines) == 10
    assert all(r.levelno == logging.WARNING for r in lines)
    assert repr(trio.lowlevel.current_task().name) in lines[0].getMessage()
    assert "1.000 s" in lines[0].getMessage()
    assert getattr(lines[0], "node", None) == "n:1"


async def test_past_the_first_few_one_slow_step_in_a_hundred_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    watch = LoopWatch(0.05, clock=clock)
    await start(watch)
    with caplog.at_level(logging.WARNING, logger="p2pactor.loopwatch"):
        await stall(clock, 1.0, times=250)
    watch.stop()
    assert watch.snapshot().slow_steps == 250
    said = [r.getMessage() for r in caplog.records if r.name == "p2pactor.loopwatch"]
    assert len(said) == 12
    assert "(slow step #100," in said[10]
    assert "(slow step #200," in said[11]


async def test_off_or_stopped_it_counts_nothing() -> None:
    clock = Clock()
    off = LoopWatch(None, clock=clock)
    off.start()
    await stall(clock, 1.0, times=3)
    assert not off.enabled
    assert off.snapshot().steps == 0

    watch = LoopWatch(0.05, clock=clock)
    await start(watch)
    await stall(clock, 1.0)
    watch.stop()
    counted = watch.snapshot()
    await stall(clock, 1.0, times=3)
    assert watch.snapshot() == counted
    watch.stop()  # idempotent


# --- a real node ----------------------------------------------------------------------


def block_the_thread(seconds: float) -> None:
    # What a blocking parent cache or watcher does to the node: holds its thread.
    time.sleep(seconds)


async def blocker(seconds: float) -> None:
    await trio.lowlevel.checkpoint()
    block_the_thread(seconds)


async def test_a_node_records_a_step_that_blocks_its_thread_and_shows_it() -> None:
    async with open_cluster("a", slow_step_s=0.02) as cluster:
        member = cluster["a"]
        node = member.node
        before = time.time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocker, 0.06, name="blocking-parent")
        after = time.time()
        seen = node.loop_watch.snapshot()
        mine = [s for s in seen.recent_slow if s.task == "blocking-parent"]
        assert len(mine) == 1
        assert mine[0].seconds >= 0.06
        assert before <= mine[0].at <= after
        assert seen.longest_step_s >= 0.06
        assert seen.steps > 0

        status = member.surface.status()
        loop = status["loop"]
        assert set(loop) == {"steps", "slow_step_s", "slow_steps", "longest_step_s", "recent_slow"}
        assert loop["slow_step_s"] == 0.02
        assert loop["slow_steps"] >= 1
        assert loop["steps"] >= seen.steps
        assert loop["longest_step_s"] >= 0.06
        shown = [s for s in loop["recent_slow"] if s["task"] == "blocking-parent"]
        assert len(shown) == 1
        assert set(shown[0]) == {"at", "seconds", "task"}
        assert shown[0]["seconds"] >= 0.06

        found = samples(member.surface.exposition())
        assert value(found, "p2pactor_loop_slow_steps_total") >= 1
        assert value(found, "p2pactor_loop_slow_steps_total") == node.loop_watch.slow_steps
        assert value(found, "p2pactor_loop_longest_step_seconds") >= 0.06

        out = io.StringIO()
        format_status(status, out)
        (line,) = [x for x in out.getvalue().splitlines() if x.startswith("loop:")]
        assert "slow (>= 20.0 ms)" in line
        assert "blocking-parent" in line
    # closed: the node took its watch out of the run
    counted = node.loop_watch.snapshot().steps
    await spin(10)
    assert node.loop_watch.snapshot().steps == counted


async def test_a_node_with_the_watch_off_says_so() -> None:
    async with open_cluster("a", slow_step_s=None) as cluster:
        member = cluster["a"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocker, 0.01, name="blocking-parent")
        loop = member.surface.status()["loop"]
        assert loop == {
            "steps": 0,
            "slow_step_s": None,
            "slow_steps": 0,
            "longest_step_s": 0.0,
            "recent_slow": [],
        }
        found = samples(member.surface.exposition())
        assert value(found, "p2pactor_loop_slow_steps_total") == 0
        out = io.StringIO()
        format_status(member.surface.status(), out)
        assert "loop: slow-step watch off" in out.getvalue()


def test_a_status_without_a_loop_prints_no_loop_line() -> None:
    status: dict[str, Any] = {"node_id": "a:1", "peers": [], "limits": []}
    out = io.StringIO()
    format_status(status, out)
    assert "loop:" not in out.getvalue()


# --- configuration --------------------------------------------------------------------


def test_the_default_and_the_environment() -> None:
    assert NodeConfig().slow_step_s == SLOW_STEP_S
    assert NodeConfig.from_env({}).slow_step_s == SLOW_STEP_S
    assert NodeConfig.from_env({"P2PACTOR_SLOW_STEP_MS": "20"}).slow_step_s == 0.02
    assert NodeConfig.from_env({"P2PACTOR_SLOW_STEP_MS": "0"}).slow_step_s is None
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(ConfigError, match="P2PACTOR_SLOW_STEP_MS"):
            NodeConfig.from_env({"P2PACTOR_SLOW_STEP_MS": bad})


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, float("inf"), float("nan"), True, "50"])
def test_a_threshold_that_is_not_seconds_above_0_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="slow_step_s"):
        NodeConfig(slow_step_s=bad)  # type: ignore[arg-type]


def test_serve_takes_the_threshold_in_milliseconds() -> None:
    parser = build_parser()

    def threshold(*flags: str, env: dict[str, str] | None = None) -> float | None:
        args = parser.parse_args(["serve", *flags])
        return config_from_args(args, env=env or {}).slow_step_s

    assert threshold() == SLOW_STEP_S
    assert threshold("--slow-step-ms", "20") == 0.02
    assert threshold("--slow-step-ms", "0") is None
    assert threshold("--slow-step-ms", "0", env={"P2PACTOR_SLOW_STEP_MS": "20"}) is None
    assert threshold(env={"P2PACTOR_SLOW_STEP_MS": "20"}) == 0.02
    with pytest.raises(ConfigError, match="--slow-step-ms"):
        threshold("--slow-step-ms", "-5")
