"""Waking a node's trio thread from an engine's thread, without paying for it there.

``run_sync_soon`` writes to trio's wake-up socket, and that send hands the GIL
to the trio thread, which then runs its whole batch before the engine thread
gets it back (~0.5 ms per ``on_schedule_end``, measured with ``p2pactor bench
--only engine``). So the engine thread only sets a :class:`threading.Event`; a
small waker thread makes the ``run_sync_soon`` call when the engine thread next
lets go of the GIL.
"""

from __future__ import annotations

import contextlib
import math
import threading

import trio


class Wakeup:
    """A trio event any thread may set. Make it on the trio thread it wakes.

    Args:
        name: For the waker thread's name.
    """

    def __init__(self, name: str) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.trio_thread = threading.get_ident()
        self._event = trio.Event()
        self._lock = threading.Lock()
        self._pending = False
        self._signal = threading.Event()
        self._stopped = False
        threading.Thread(target=self._loop, name=f"p2pactor-waker {name}", daemon=True).start()

    def set(self) -> None:
        """Wake :meth:`wait`: at once on the trio thread, through the waker from any other."""
        if threading.get_ident() == self.trio_thread:
            self._event.set()  # on the trio thread itself: no hop needed
            return
        with self._lock:
            if self._pending:
                return
            self._pending = True
        self._signal.set()

    async def wait(self, at_most: float = math.inf) -> None:
        """Wait until set (or ``at_most`` seconds pass), then clear (trio thread)."""
        with trio.move_on_after(at_most):
            await self._event.wait()
        self._event = trio.Event()

    def stop(self) -> None:
        """Stop the waker thread (the node is closing)."""
        self._stopped = True
        self._signal.set()

    def _loop(self) -> None:
        while True:
            self._signal.wait()
            self._signal.clear()
            if self._stopped:
                return
            # If the run is gone, nothing waits for the event anyway.
            with contextlib.suppress(trio.RunFinishedError):
                self.token.run_sync_soon(self._woken)

    def _woken(self) -> None:
        with self._lock:
            self._pending = False
        self._event.set()
