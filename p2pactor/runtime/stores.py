"""The store desk: where the stored blocks of prefill/decode requests wait for their fetch.

In a prefill/decode split the prefill engine *stores* a request's blocks
(``Node.submit_store``) before, or after, the decode engine's fetch for that
kv_request_id arrives. vLLM binds a request id to the session its fetch came
on; stores for it go to that request's producer from then on. Until a fetch
binds it, a store *waits* here; one that waits longer than
``unbound_store_timeout`` is *reaped*: its pin released with a WARNING saying
why, and nothing can be served under that id for a while (a late fetch fails at
once, a late store is refused).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from p2pactor.core import inputs as inp
from p2pactor.runtime.actor import Ground, RequestActor
from p2pactor.runtime.logcontext import request_context

log = logging.getLogger("p2pactor.node")

# How long a reaped request id is remembered (vLLM keeps these 60 s too).
REAPED_MEMORY_S = 60.0


@attrs.define(eq=False)
class StoreDesk:
    """Stores of prefill/decode requests, bound to their producers or waiting for a fetch.

    A bound producer that has ended (``done``) takes no store: one for it waits
    for the next fetch instead.

    Args:
        ground: The node's (its ``unbound_store_timeout``: how long a store waits).
        release: Releases a pin job (``success=False``) through the parent.
    """

    _ground: Ground
    _release: Callable[[int], None]
    deadline: float | None = attrs.field(default=None, init=False)  # the reaper's, on the timer
    _bound: dict[str, RequestActor] = attrs.field(factory=dict, init=False)
    _waiting: dict[str, list[tuple[float, inp.AddStore]]] = attrs.field(factory=dict, init=False)
    _finished: set[str] = attrs.field(factory=set, init=False)  # waiting ones the engine finished
    _reaped: dict[str, float] = attrs.field(factory=dict, init=False)
    _binds: int = attrs.field(default=0, init=False)

    def _live(self, kv_request_id: str) -> RequestActor | None:
        bound = self._bound.get(kv_request_id)
        return None if bound is None or bound.done else bound

    def store(self, kv_request_id: str, store: inp.AddStore) -> None:
        """Give stored blocks to the request's producer, or keep them until its fetch."""
        bound = self._live(kv_request_id)
        if bound is not None:
            self._ground.runner.deliver(bound, store)
        elif kv_request_id in self._reaped:
            log.warning(
                "%s: refused a store that came after its blocks were released (no fetch "
                "within unbound_store_timeout, %g s); raise it if fetches come this late",
                kv_request_id,
                self._ground.config.unbound_store_timeout,
                extra=request_context(None, kv_request_id, node=self._ground.config.node_id),
            )
            self._release(store.job_id)
        else:
            self._bound.pop(kv_request_id, None)
            self._waiting.setdefault(kv_request_id, []).append((self._ground.clock(), store))
            self._arm()

    def bind(self, actor: RequestActor) -> None:
        """A fetch opened ``actor``: the request's waiting stores go to it, then its finish.

        As vLLM binds a request id to the session its fetch came on: stores for
        it go to this actor from now on. A reaped id can never be served: it is
        finished at once, so its fetch fails now instead of at the consumer's
        30 s load timeout.
        """
        kv_id = actor.id.kv_request_id
        self._bound[kv_id] = actor
        self._binds += 1
        if self._binds % 1024 == 0:
            # Ended producers bind nothing (every use checks): forget them, or a
            # peer flooding fresh request ids piles them up here.
            self.forget(lambda bound: bound.done)
        waiting = self._waiting.pop(kv_id, [])
        finished = kv_id in self._finished or kv_id in self._reaped
        self._finished.discard(kv_id)
        for _, store in waiting:
            self._ground.runner.deliver(actor, store)
        if finished:
            self._ground.runner.deliver(actor, inp.Finish())

    def finish(self, kv_request_id: str) -> None:
        """The engine stores no more for ``kv_request_id``: finish its producer, if bound."""
        bound = self._live(kv_request_id)
        if bound is not None:
            self._ground.runner.deliver(bound, inp.Finish())
        elif kv_request_id in self._waiting:
            self._finished.add(kv_request_id)

    def forget(self, ended: Callable[[RequestActor], bool]) -> None:
        """Forget the bindings whose producer ``ended`` says is gone (its session closed)."""
        for kv_id in [k for k, actor in self._bound.items() if ended(actor)]:
            del self._bound[kv_id]

    def expire(self) -> None:
        """Release the stores no fetch came for within ``unbound_store_timeout``."""
        self.deadline = None
        now, timeout = self._ground.clock(), self._ground.config.unbound_store_timeout
        self._reaped = {k: at for k, at in self._reaped.items() if at > now - REAPED_MEMORY_S}
        for kv_id, waiting in list(self._waiting.items()):
            if waiting[0][0] > now - timeout:
                continue
            del self._waiting[kv_id]
            self._finished.discard(kv_id)
            self._reaped[kv_id] = now
            for _, store in waiting:
                log.warning(
                    "no fetch came for %s within unbound_store_timeout (%g s); releasing its "
                    "stored blocks (check that the decode side runs and reaches this node)",
                    kv_id,
                    timeout,
                    extra=request_context(None, kv_id, node=self._ground.config.node_id),
                )
                self._release(store.job_id)
        self._arm()

    def _arm(self) -> None:
        timeout = self._ground.config.unbound_store_timeout
        times = [w[0][0] + timeout for w in self._waiting.values()]
        times.extend(at + REAPED_MEMORY_S for at in self._reaped.values())
        deadline = min(times, default=None)
        if deadline is not None and (self.deadline is None or deadline < self.deadline):
            self.deadline = deadline
            self._ground.timers.arm(self)
