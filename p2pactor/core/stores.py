"""Where the stored blocks of prefill/decode requests wait for the fetch that takes them.

In a prefill/decode split the prefill engine *stores* a request's blocks
(``Node.submit_store``) before, or after, the decode engine's fetch for that
kv_request_id arrives. vLLM binds a request id to the session its fetch came
on; stores for it go to that request's producer from then on. Until a fetch
binds it, a store *waits* here; one that waits longer than
``unbound_store_timeout`` is *reaped* (its pin released, nothing can be served
under that id for a while: a late fetch fails at once, a late store is
refused).

:class:`StoreBook` is that policy, sans-IO: it holds no I/O, reads no clock
(``now`` is an argument) and never calls an actor. Each method returns what
the runtime must do, as data. ``H`` is the runtime's handle for a producer
request (its actor); the book only compares handles and asks ``alive(h)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

from p2pactor.core import inputs as inp

H = TypeVar("H")

# How long a reaped request id is remembered (vLLM keeps these 60 s too).
REAPED_MEMORY_S = 60.0


class Unbound(msgspec.Struct, frozen=True, gc=False):
    """A store no fetch has bound yet: it waits in the book."""


class StoreRefused(msgspec.Struct, frozen=True, gc=False):
    """A store that came after its request's blocks were reaped: release its pin now."""

    job_id: int
    reason: str


class Reaped(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A waiting store no fetch came for in time: release its pin now."""

    kv_request_id: str
    job_id: int


class _Waiting(msgspec.Struct, frozen=True, gc=False):
    at: float
    store: inp.AddStore


class StoreBook(Generic[H]):
    """The stores of prefill/decode requests, bound to their producers or waiting.

    Args:
        unbound_timeout: How long a store may wait for its fetch.
        alive: Whether a bound handle still takes input (its request has not
            ended); a store for an ended one waits for the next fetch instead.
    """

    def __init__(self, unbound_timeout: float, alive: Callable[[H], bool]) -> None:
        self.unbound_timeout = unbound_timeout
        self._alive = alive
        self._bound: dict[str, H] = {}
        self._waiting: dict[str, list[_Waiting]] = {}
        self._finished: set[str] = set()  # waiting ones the engine finished
        self._reaped: dict[str, float] = {}
        self._binds = 0

    def __len__(self) -> int:
        """Request ids bound or waiting."""
        return len(self._bound) + len(self._waiting)

    @property
    def bound(self) -> int:
        """Request ids bound to a producer (some may have ended)."""
        return len(self._bound)

    @property
    def waiting(self) -> int:
        """Stores waiting for their fetch."""
        return sum(len(w) for w in self._waiting.values())

    def store(
        self, kv_request_id: str, store: inp.AddStore, now: float
    ) -> H | Unbound | StoreRefused:
        """The engine stored blocks of ``kv_request_id``.

        Returns:
            The live handle to give ``store`` to; :class:`Unbound` if it waits
            here now; :class:`StoreRefused` if the id was reaped.
        """
        bound = self._bound.get(kv_request_id)
        if bound is not None and self._alive(bound):
            return bound
        if kv_request_id in self._reaped:
            return StoreRefused(
                store.job_id,
                f"{kv_request_id}: refused a store that came after its blocks were released "
                f"(no fetch within unbound_store_timeout, {self.unbound_timeout:g} s); raise it "
                "if fetches come this late",
            )
        self._bound.pop(kv_request_id, None)
        self._waiting.setdefault(kv_request_id, []).append(_Waiting(now, store))
        return Unbound()

    def bind(self, kv_request_id: str, handle: H) -> tuple[tuple[inp.AddStore, ...], bool]:
        """A fetch of ``kv_request_id`` opened ``handle``: stores for the id go to it now.

        Returns:
            The stores that were waiting, to give it in order, and whether it
            must then be finished (the engine finished the request, or its
            blocks were reaped: nothing more can be served under the id).
        """
        self._bound[kv_request_id] = handle
        self._binds += 1
        if self._binds % 1024 == 0:
            # Ended handles bind nothing (every use checks alive): forget them,
            # or a peer flooding fresh request ids piles them up here.
            for ended in [k for k, h in self._bound.items() if not self._alive(h)]:
                del self._bound[ended]
        waiting = self._waiting.pop(kv_request_id, [])
        finished = kv_request_id in self._finished or kv_request_id in self._reaped
        self._finished.discard(kv_request_id)
        return tuple(w.store for w in waiting), finished

    def finish(self, kv_request_id: str) -> H | None:
        """The engine stores no more for ``kv_request_id``: the live handle to finish, if any."""
        bound = self._bound.get(kv_request_id)
        if bound is not None and self._alive(bound):
            return bound
        if kv_request_id in self._waiting:
            self._finished.add(kv_request_id)
        return None

    def unbind(self, ended: Callable[[H], bool]) -> None:
        """Forget every binding whose handle ``ended`` says is gone (its session closed)."""
        for kv_id in [k for k, h in self._bound.items() if ended(h)]:
            del self._bound[kv_id]

    def next_deadline(self) -> float | None:
        """When :meth:`reap` next has something to do, if ever."""
        times = [w[0].at + self.unbound_timeout for w in self._waiting.values() if w]
        times.extend(at + REAPED_MEMORY_S for at in self._reaped.values())
        return min(times, default=None)

    def reap(self, now: float) -> list[Reaped]:
        """Release the stores that waited too long; forget ids reaped long ago."""
        cutoff = now - self.unbound_timeout
        out: list[Reaped] = []
        for kv_id, waiting in list(self._waiting.items()):
            if waiting and waiting[0].at <= cutoff:
                del self._waiting[kv_id]
                self._finished.discard(kv_id)
                self._reaped[kv_id] = now
                out.extend(Reaped(kv_request_id=kv_id, job_id=w.store.job_id) for w in waiting)
        remembered = now - REAPED_MEMORY_S
        for kv_id, when in list(self._reaped.items()):
            if when <= remembered:
                del self._reaped[kv_id]
        return out

    def reaped(self, kv_request_id: str) -> bool:
        """Whether ``kv_request_id``'s stores were reaped recently."""
        return kv_request_id in self._reaped
