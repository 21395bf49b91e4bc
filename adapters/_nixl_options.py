"""How a NIXL data transport is driven (UCX's environment too), and what it counts."""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from collections.abc import Iterator
from functools import partial
from typing import Final

import attrs

from p2pactor.core import checks
from p2pactor.runtime import logcontext

# Polls and deadlines are computed from these: inf would never end.
_positive = checks.positive(finite=True)
_not_negative = checks.non_negative(finite=True)
_positive_or_none: checks.Validator = attrs.validators.optional(_positive)


log = logging.getLogger("p2pactor.nixl")


note: Final = partial(logcontext.note, log, prefix="NIXL agent ", who_is_node=False)
"""Log ``NIXL agent <agent>: message`` (``%``-formatted), with ``peer`` as its field."""


# Held while os.environ is read and set (ucx_tcp_environment).
_ENVIRON_LOCK = threading.Lock()


@attrs.frozen(kw_only=True)
class NixlOptions:
    """How a :class:`~p2pactor.adapters.nixl.NixlDataTransport` drives its NIXL agent.

    Times are in seconds.

    Attributes:
        transfer_timeout: How long a write may run before it is cancelled
            (vLLM's load timeout is 30 s; a write must fail before the
            consumer's load does, or at the latest with it).
        close_timeout: How long closing waits for writes still in flight
            before it releases what is left anyway.
        connect_eagerly: Connect to a peer's agent as it is added, so its first
            write does not pay the connection setup (measured 0.2-19 ms).
        backends: NIXL backends the agent instantiates.
        num_threads: Worker threads of the UCX backend (0: none, UCX's own
            default). vLLM uses 4 on large hosts; on small ones threads only
            compete with the engine.
        busy_polls: Polls of a write in flight that only yield to other trio
            tasks before the pump starts sleeping between polls.
        min_poll_interval: The pump's first sleep once the busy polls found
            nothing; it doubles up to ``max_poll_interval``. On Linux trio
            waits in epoll, whose timeout is whole milliseconds, so any sleep
            under 1 ms lasts about 1 ms there (measured 1.1-1.2 ms); finer
            polling would mean spinning on the trio thread, against the
            engine's threads for the GIL.
        max_poll_interval: The longest the pump sleeps while writes are in
            flight: the most latency polling adds to a write.
        idle_poll_interval: How often the pump drives the agent's progress
            while no write of its own is in flight but a peer's may be
            running: while one is expected
            (:meth:`~p2pactor.adapters.nixl.NixlDataTransport.expect_writes`)
            or for ``wireup_grace``.
        inline_post_budget: Post a write on the trio thread when its
            ``transfer()`` is predicted, from the time per byte earlier posts
            took, to return within this many seconds: the longest the loop
            may stall for it. 0 always uses the worker thread. A prediction
            is a moving average: on a loaded machine a post can run twice as
            long (measured on 2 busy cores: 4 ms predicted, up to 10 ms
            stalled), hence a default well under the few ms a control
            message may wait. It skips the hop (0.25-0.6 ms there) for
            writes up to about 4 MiB on shared memory.
        wireup_grace: How long after registering a peer the pump keeps
            driving progress even with nothing in flight or expected: the
            peer's side of the connection setup may need our agent to answer.
        progress_thread_wakeup: Run NIXL's own progress thread, which sleeps
            in ``poll()`` on the UCX worker's event fd and also wakes at least
            this often (NIXL's guard against a missed event; it rounds up to
            whole milliseconds). It progresses the agent without the GIL the
            moment a peer's bytes arrive, which over TCP sets how fast a
            peer's write lands (``docs/design.md``, "The NIXL transport"). A
            short wakeup costs CPU: at 1 ms the producer's thread spun on the
            UCX worker's lock behind each long ``transfer()`` (CPU per
            256 x 1 MiB fetch 80 -> 135 ms, the loop stalled 25 ms); at
            100 ms it costs 95 ms and 6 ms. ``None`` turns the thread off: the
            pump then drives progress every ``idle_poll_interval`` while a
            peer's write is expected or for ``wireup_grace``.
        tcp_timeout: UCX's TCP connections to a peer that stopped answering
            are dropped after about this long: before it makes its agent the
            transport sets ``UCX_TCP_USER_TIMEOUT`` to it and
            ``UCX_TCP_KEEPIDLE`` and ``UCX_TCP_KEEPINTVL`` to half of it (at
            least 1 s), unless the environment already sets them. A dropped
            connection delivers nothing more, which bounds how long a peer's
            write may still land after its session was lost
            (:attr:`late_write_window`); Linux's own default retries for about
            15 minutes, and a link that comes back resumes the write. None
            leaves UCX's defaults, and no bound.
    """

    transfer_timeout: float = attrs.field(default=30.0, validator=_positive)
    close_timeout: float = attrs.field(default=5.0, validator=_positive)
    connect_eagerly: bool = True
    backends: tuple[str, ...] = attrs.field(default=("UCX",), converter=tuple)
    num_threads: int = attrs.field(default=0, validator=checks.non_negative_int)
    busy_polls: int = attrs.field(default=4, validator=checks.non_negative_int)
    min_poll_interval: float = attrs.field(default=20e-6, validator=_positive)
    max_poll_interval: float = attrs.field(default=1e-3, validator=_positive)
    idle_poll_interval: float = attrs.field(default=1e-3, validator=_positive)
    inline_post_budget: float = attrs.field(default=2e-3, validator=_not_negative)
    wireup_grace: float = attrs.field(default=2.0, validator=_not_negative)
    progress_thread_wakeup: float | None = attrs.field(default=0.1, validator=_positive_or_none)
    tcp_timeout: float | None = attrs.field(default=1.0, validator=_positive_or_none)

    @property
    def late_write_window(self) -> float:
        """How long after a peer went silent its write into our pool may still land.

        A connection to a silent peer is dropped within about twice
        ``tcp_timeout`` (TCP checks the timeout as its retransmissions fire,
        each twice as late as the one before); a link back before that
        resumes the stalled write within about as long again. Add a second
        for the bytes themselves: a resumed write so large that it takes
        longer on its link is bounded only by the producer's transfer_timeout.
        0 when ``tcp_timeout`` is None: nothing bounds it.
        """
        return 0.0 if self.tcp_timeout is None else 4 * self.tcp_timeout + 1.0

    def ucx_environment(self) -> dict[str, str]:
        """The UCX variables ``tcp_timeout`` sets (where the environment does not)."""
        if self.tcp_timeout is None:
            return {}
        keepalive = max(1, round(self.tcp_timeout / 2))
        return {
            "UCX_TCP_USER_TIMEOUT": f"{round(self.tcp_timeout * 1000)}ms",
            "UCX_TCP_KEEPIDLE": f"{keepalive}s",
            "UCX_TCP_KEEPINTVL": f"{keepalive}s",
        }

    def poll_intervals(self) -> Iterator[float]:
        """The pump's sleeps between polls that found nothing new (0: a checkpoint)."""
        yield from itertools.repeat(0.0, self.busy_polls)
        interval = self.min_poll_interval
        while True:
            yield min(interval, self.max_poll_interval)
            interval *= 2


_UCX_TIME = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(s|ms|us|ns|m)?\s*", re.IGNORECASE)
_UCX_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "m": 60.0}


def ucx_tcp_environment(options: NixlOptions) -> float:
    """Set UCX's TCP timeouts the environment leaves unset; the late-write window in effect.

    UCX reads its configuration from the process environment as an agent is
    made, so what counts is the value there: the operator's own, or the first
    transport's. The window is computed from it, not from ``options``.
    """
    with _ENVIRON_LOCK:
        for variable, value in options.ucx_environment().items():
            os.environ.setdefault(variable, value)
        in_effect = os.environ.get("UCX_TCP_USER_TIMEOUT")
    if in_effect is None:
        return 0.0  # tcp_timeout is None, and the environment sets nothing either
    # A UCX time ("1000ms", "2s", "2": seconds); "inf" and "auto" bound nothing.
    match = _UCX_TIME.fullmatch(in_effect)
    seconds = 0.0 if match is None else float(match[1]) * _UCX_UNITS[(match[2] or "s").lower()]
    if seconds <= 0:
        window = options.late_write_window
        log.warning(
            "UCX_TCP_USER_TIMEOUT=%s bounds nothing: a write a link flap cut may land in "
            "blocks long after its load failed. Holding a lost load's blocks %g s anyway; "
            "unset it (p2pactor sets 1000ms) or give it a time",
            in_effect,
            window,
        )
        return window
    return attrs.evolve(options, tcp_timeout=seconds).late_write_window


@attrs.define(kw_only=True)
class Tally:
    """The part of :class:`NixlStatistics` a transport keeps up to date as it runs."""

    writes_done: int = 0
    writes_failed: int = 0
    bytes_written: int = 0
    posted_inline: int = 0
    progress_polls: int = 0
    idle: bool = False


@attrs.frozen(kw_only=True)
class NixlStatistics(Tally):
    """Counters of a NIXL transport, from its ``statistics()``.

    Attributes:
        peers: Peer names registered (or being registered).
        remote_agents: Distinct remote NIXL agents loaded.
        writes_in_flight: Writes started and not yet over (zombies included).
        zombies: Writes past their deadline that NIXL would not cancel yet.
        progress_thread: NIXL's own progress thread runs
            (:attr:`NixlOptions.progress_thread_wakeup`).
        writes_done: Writes that completed.
        writes_failed: Writes that raised :class:`~p2pactor.runtime.transport.TransferError`
            after reaching NIXL.
        bytes_written: Bytes of the completed writes.
        posted_inline: Writes posted on the trio thread (predicted quick).
        progress_polls: Times the pump drove the agent's progress.
        idle: The pump sleeps: nothing in flight, nothing expected (with
            NIXL's progress thread on: nothing of its own in flight).
    """

    peers: int
    remote_agents: int
    writes_in_flight: int
    zombies: int
    progress_thread: bool
