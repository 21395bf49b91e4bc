"""The store desk: the node's side of prefill/decode stores (policy: core.stores).

The pure :class:`~p2pactor.core.stores.StoreBook` decides where a store goes,
when a waiting one is reaped and what a fetch binds; the desk does what it
decides: gives stores to producers (through the runner), releases the pins of
refused and reaped stores (through the parent service) with a WARNING saying
why, and arms the node's timer for the book's next deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from p2pactor.core import inputs as inp
from p2pactor.core.stores import StoreBook, StoreRefused, Unbound
from p2pactor.runtime.actor import RequestActor, Runner
from p2pactor.runtime.logcontext import request_context
from p2pactor.runtime.timers import Timers

log = logging.getLogger("p2pactor.node")


class StoreDesk:
    """Stores of prefill/decode requests, bound to their producers or waiting for a fetch.

    Args:
        node_id: For log lines.
        unbound_timeout: ``unbound_store_timeout``: how long a store waits.
        runner: Where stores and finishes reach producers.
        timers: Where the reaping of waiting stores is armed.
        release: Releases a pin job (``success=False``) through the parent.
        clock: The node's clock.
    """

    def __init__(
        self,
        *,
        node_id: str,
        unbound_timeout: float,
        runner: Runner,
        timers: Timers,
        release: Callable[[int], None],
        clock: Callable[[], float],
    ) -> None:
        self._node_id = node_id
        self._runner = runner
        self._timers = timers
        self._release = release
        self._clock = clock
        self.book: StoreBook[RequestActor] = StoreBook(
            unbound_timeout, alive=lambda actor: not actor.done
        )
        self.deadline: float | None = None  # the reaper's, on the node's timer

    def store(self, kv_request_id: str, store: inp.AddStore) -> None:
        """Give stored blocks to the request's producer, or keep them until its fetch."""
        verdict = self.book.store(kv_request_id, store, self._clock())
        if isinstance(verdict, StoreRefused):
            log.warning(
                "%s",
                verdict.reason,
                extra=request_context(None, kv_request_id, node=self._node_id),
            )
            self._release(store.job_id)
        elif isinstance(verdict, Unbound):
            self._arm()
        else:
            self._runner.deliver(verdict, store)

    def bind(self, actor: RequestActor) -> None:
        """A fetch opened ``actor``: the request's waiting stores go to it, then its finish.

        As vLLM binds a request id to the session its fetch came on: stores for
        it go to this actor from now on. A reaped id can never be served: it is
        finished at once, so its fetch fails now instead of at the consumer's
        30 s load timeout.
        """
        stores, finished = self.book.bind(actor.id.kv_request_id, actor)
        for store in stores:
            self._runner.deliver(actor, store)
        if finished:
            self._runner.deliver(actor, inp.Finish())

    def finish(self, kv_request_id: str) -> None:
        """The engine stores no more for ``kv_request_id``: finish its producer, if bound."""
        bound = self.book.finish(kv_request_id)
        if bound is not None:
            self._runner.deliver(bound, inp.Finish())

    def forget(self, ended: Callable[[RequestActor], bool]) -> None:
        """Forget the bindings whose producer ``ended`` says is gone (its session closed)."""
        self.book.unbind(ended)

    def expire(self) -> None:
        """Release the stores no fetch came for within ``unbound_store_timeout``."""
        self.deadline = None
        for reaped in self.book.reap(self._clock()):
            log.warning(
                "no fetch came for %s within unbound_store_timeout (%g s); releasing its "
                "stored blocks (check that the decode side runs and reaches this node)",
                reaped.kv_request_id,
                self.book.unbound_timeout,
                extra=request_context(None, reaped.kv_request_id, node=self._node_id),
            )
            self._release(reaped.job_id)
        self._arm()

    def _arm(self) -> None:
        deadline = self.book.next_deadline()
        if deadline is not None and (self.deadline is None or deadline < self.deadline):
            self.deadline = deadline
            self._timers.arm(self)
