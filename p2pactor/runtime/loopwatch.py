"""The slow-step watch: which piece of work held the node's trio thread, and how long.

Everything a node does runs on one thread, its trio loop, one task step at a
time: a frame handled as it arrives, the timer's deadlines, the engine's calls
applied. A step that runs long (a blocking call in a parent cache or a
watcher, a garbage-collector pause inside it, a machine short of CPU) holds
every other peer, timer and engine call meanwhile. :class:`LoopWatch` is a
:class:`trio.abc.Instrument` that times every task step and records those that
took at least ``NodeConfig.slow_step_s``: a count, the longest step seen, and
the most recent :data:`RECENT_SLOW`, each with its task's name. It is
asyncio's ``slow_callback_duration`` without debug mode, cheap enough to stay
on in production (``docs/status.md`` has the measurement).

``open_node`` adds it to the trio run it is opened in
(:func:`trio.lowlevel.add_instrument`, so a node on a thread of its own, as
under vLLM, is watched the same) and removes it when the node closes. It sees
every task of that run: nodes sharing one run (tests, benches) each see the
others' steps too, as they share the thread. Time spent between steps (waiting
for I/O, trio's own scheduling) is not a step and is never counted.

The operator surface reads :meth:`LoopWatch.snapshot` (``/status``'s ``loop``,
``/metrics``' ``p2pactor_loop_*``); the runtime never imports the surface.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Final

import attrs
import trio

log = logging.getLogger("p2pactor.loopwatch")

RECENT_SLOW: Final = 32
"""Slow steps a watch keeps (the most recent); ``slow_steps`` counts them all."""

_LOGGED_FIRST: Final = 10
_LOG_EVERY: Final = 100
"""Past the first :data:`_LOGGED_FIRST`, one slow step in this many is logged."""


@attrs.frozen
class SlowStep:
    """One task step that held the node's thread at least ``slow_step_s``.

    Attributes:
        at: When it ended, Unix time.
        seconds: How long it ran.
        task: The trio task's name (what ``start_soon`` was given, else its
            function's qualified name).
    """

    at: float
    seconds: float
    task: str


@attrs.frozen
class LoopSnapshot:
    """What a :class:`LoopWatch` has seen so far.

    Attributes:
        steps: Task steps timed (0 while the watch is off).
        slow_step_s: The threshold, or None: the watch is off.
        slow_steps: Steps that ran at least ``slow_step_s``.
        longest_step_s: The longest step timed, slow or not (0 before any).
        recent_slow: The last :data:`RECENT_SLOW` slow steps, newest first.
    """

    steps: int
    slow_step_s: float | None
    slow_steps: int
    longest_step_s: float
    recent_slow: tuple[SlowStep, ...]


class LoopWatch(trio.abc.Instrument):
    """Times every task step of the trio run it is added to; records the slow ones.

    Made by the node (``NodeHost``) from ``NodeConfig.slow_step_s``;
    :meth:`start` and :meth:`stop` are ``open_node``'s. Counters are written
    on the node's thread only; :meth:`snapshot` may be read from any thread.

    Args:
        slow_step_s: The threshold in seconds; None: off (never added).
        node_id: The node named in the log lines.
        clock: Where step times come from (``time.perf_counter``; tests
            give their own).
    """

    def __init__(
        self,
        slow_step_s: float | None,
        *,
        node_id: str = "",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.slow_step_s = slow_step_s
        """The threshold in seconds, or None: off."""
        self.node_id = node_id
        """The node named in the log lines."""
        self.steps = 0
        """Task steps timed."""
        self.slow_steps = 0
        """Steps that ran at least ``slow_step_s``."""
        self._clock = clock
        self._slow = math.inf if slow_step_s is None else slow_step_s
        self._longest = 0.0
        # min(longest, slow): a step under it changes nothing, so the common
        # step costs one comparison (trio calls both hooks on every step of
        # every task, some 10k a second on a busy node). Longest only grows:
        # it is rarely passed.
        self._bar = 0.0
        # inf: the step running when the watch is added ends with no start
        # (-inf seconds), and is not counted.
        self._started = math.inf
        self._recent: collections.deque[SlowStep] = collections.deque(maxlen=RECENT_SLOW)
        self._watching = False

    @property
    def enabled(self) -> bool:
        """Whether the watch is on (``slow_step_s`` is set)."""
        return self.slow_step_s is not None

    def start(self) -> None:
        """Watch the trio run this is called in, from its next step on; a no-op when off."""
        if self.slow_step_s is None or self._watching:
            return
        self._started = math.inf
        trio.lowlevel.add_instrument(self)
        self._watching = True

    def stop(self) -> None:
        """Stop watching (the counts stay readable). Idempotent."""
        if not self._watching:
            return
        self._watching = False
        # KeyError: trio already removed it, after one of its hooks raised.
        with contextlib.suppress(KeyError):
            trio.lowlevel.remove_instrument(self)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        """A step of ``task`` begins (the hook trio calls)."""
        self._started = self._clock()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        """The step of ``task`` ended (the hook trio calls)."""
        seconds = self._clock() - self._started
        self.steps += 1
        if seconds < self._bar:
            return  # neither the longest so far nor slow: the common step
        self._longest = max(self._longest, seconds)
        self._bar = min(self._longest, self._slow)
        if seconds < self._slow:
            return
        self.slow_steps += 1
        self._recent.append(SlowStep(time.time(), seconds, task.name))
        count = self.slow_steps
        # A node stalled over and over must not flood the log: the first
        # few, then one in _LOG_EVERY; /status and /metrics count them all.
        if count <= _LOGGED_FIRST or count % _LOG_EVERY == 0:
            log.warning(
                "task %r held the node's trio thread for %.3f s in one step (slow step "
                "#%d, slow_step_s %.3f; logged: the first %d, then 1 in %d): no peer's "
                "message, timer or engine call ran meanwhile. Look for blocking work in that "
                "task (a parent cache, a watcher), a garbage-collector pause, or a machine "
                "short of CPU; /status's loop lists the recent ones (docs/status.md)",
                task.name,
                seconds,
                count,
                self._slow,
                _LOGGED_FIRST,
                _LOG_EVERY,
                extra={"node": self.node_id} if self.node_id else None,
            )

    def snapshot(self) -> LoopSnapshot:
        """What the watch has seen so far. Any thread (a copy; never waits)."""
        # list() is one C call: the node's thread cannot append midway.
        recent = tuple(reversed(list(self._recent)))
        return LoopSnapshot(self.steps, self.slow_step_s, self.slow_steps, self._longest, recent)
