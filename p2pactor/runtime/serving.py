"""The parent service: runs the producers' parent requests and releases their pins.

A producer never touches the engine's cache (the *parent*): its events ask for
lookups, closes and releases (:class:`~p2pactor.core.effects.ParentLookup`,
``ParentClose``, ``ReleasePin``) and the node's :class:`ParentService` runs them
while it may touch the cache:

* an **embedded** parent (the demo, the tests, ``p2pactor serve``: a cache in
  the node's own process) is asked inline, in the step that asked, and its
  answer is stepped right after (through the runner);
* a **lent** parent (vLLM's ``ParentManager``) may be touched only inside
  ``serve_external_requests``: requests queue until then, and
  :meth:`ParentService.serve` answers them all in one batch, on the engine's
  thread; the node steps the answers on its own.

A re-poll of pending keys that finds nothing new stays parked and is asked
again at the next serve (lent) or after ``pending_poll_interval`` (embedded),
as vLLM re-polls parked lookups: the actor hears back only when something
changed or time ran out, so a key pending for 5 s costs two events, not one
per poll. Pins are counted against the peer's pinned-blocks quota where they
are made, here.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator

import attrs

from p2pactor.core import effects as fx
from p2pactor.core import inputs as inp
from p2pactor.core.inputs import LookupResult
from p2pactor.core.producer import ProducerState
from p2pactor.runtime.actor import Ground, RequestActor
from p2pactor.runtime.logcontext import parent_request_context
from p2pactor.runtime.parent import Parent
from p2pactor.runtime.quotas import QuotaLedger

log = logging.getLogger("p2pactor.parent")

# What producers ask of the parent, in order, with the actor owed the answer.
_Item = tuple[RequestActor | None, fx.ParentRequest | fx.ReleasePin]

# A parent answer and the actor it is for.
Answered = tuple[RequestActor, inp.ParentAnswer]


def serve_parent_request(
    parent: Parent,
    request: fx.ParentLookup,
    now: float,
    *,
    pin_budget: int | None = None,
    refusal: str = "",
) -> inp.ParentAnswer:
    """Serve one lookup request against ``parent`` while it is lent.

    Looks every key up and pins all hits with one job, in one go, so nothing can
    be evicted in between. A request past its ``not_after`` is not served at
    all. Errors from the parent turn the affected keys into misses rather than
    escaping: the engine's cache must not be able to crash the node.

    Args:
        parent: The lent cache.
        request: What to look up.
        now: The time, checked against ``request.not_after``.
        pin_budget: Most blocks to pin (the peer's pinned-blocks quota left);
            hits past it, in the request's key order so a prefix is kept, are
            returned in ``refused`` and not pinned. None: no limit.
        refusal: The reason to give for ``refused`` keys.
    """
    context = request.context
    lookup_id = request.lookup_id
    if request.not_after is not None and now >= request.not_after:
        return inp.ParentAnswer(lookup_id=lookup_id, expired=True)
    if request.open_context:
        try:
            parent.on_new_request(context)
        except Exception:
            _failed(f"refused to open {context}; answering MISS", context)
            misses = tuple((key, LookupResult.MISS) for key in request.keys)
            return inp.ParentAnswer(lookup_id=lookup_id, results=misses)
    results: list[tuple[bytes, LookupResult]] = []
    for key in request.keys:
        try:
            result = parent.lookup(key, context)
        except Exception:
            _failed(f"lookup failed in {context}; answering MISS", context)
            result = LookupResult.MISS
        results.append((key, result))
    hits = [k for k, r in results if r is LookupResult.HIT]
    cut = len(hits) if pin_budget is None else max(0, pin_budget)
    hits, refused = hits[:cut], hits[cut:]
    pin = None
    if hits:
        with _guarded(f"could not pin {len(hits)} hits in {context}; none pinned", context):
            pin = parent.create_store_job(hits, context)
    return inp.ParentAnswer(
        lookup_id=lookup_id,
        results=tuple(results),
        pin=pin,
        refused=tuple(refused),
        refusal=refusal if refused else "",
    )


def _failed(what: str, context: str = "", *, node: str | None = None) -> None:
    """Log the traceback of a call into the parent that raised: a bug of the engine's."""
    log.exception(
        "the parent %s (a bug in the engine's parent: see the traceback)",
        what,
        extra=parent_request_context(context, node=node),
    )


@contextlib.contextmanager
def _guarded(what: str, context: str = "", *, node: str | None = None) -> Iterator[None]:
    """Run a call into the parent; if it raises, log it (:func:`_failed`) and go on."""
    try:
        yield
    except Exception:
        _failed(what, context, node=node)


@attrs.define(eq=False)
class ParentService:
    """Runs parent requests against an embedded parent at once, or a lent one in batches.

    Args:
        ground: The node's (its ``timings.pending_poll_interval``: how often
            parked lookups are asked again, embedded).
        quotas: The node's quota counts (pins are counted here).
        embedded: The in-process parent, or None when the engine lends one.
    """

    _ground: Ground
    _quotas: QuotaLedger
    _embedded: Parent | None
    _queue: deque[_Item] = attrs.field(factory=deque, init=False)  # lent: until the next serve
    _parked: list[_Item] = attrs.field(factory=list, init=False)
    deadline: float | None = attrs.field(default=None, init=False)  # embedded: the next re-poll

    @property
    def pending(self) -> bool:
        """Whether any request waits (queued or parked). Any thread."""
        return bool(self._queue or self._parked)

    def post(self, actor: RequestActor | None, request: fx.ParentRequest | fx.ReleasePin) -> None:
        """Run ``request`` now (embedded) or at the next serve (lent). Node's thread.

        ``actor`` is owed a lookup's answer; None for a release or a close whose
        actor is gone (its session closed with the request open).
        """
        if self._embedded is None:
            self._queue.append((actor, request))
            return
        # Embedded: nothing ever waits in the queue, so this one goes first.
        answered = self._one(self._embedded, (actor, request), self._ground.clock())
        if answered is not None:
            self._ground.runner.deliver(*answered)
        self._arm()

    def expire(self) -> None:
        """Ask the parked lookups again (embedded; the node's timer calls this)."""
        self.deadline = None
        if self._embedded is not None:
            for answered in self.serve(self._embedded):
                self._ground.runner.deliver(*answered)
            self._arm()

    def drain(self) -> None:
        """The node closes: serve what is left, releasing every pin an answer carries."""
        parent = self._embedded
        if parent is None:
            return
        for _, answer in self.serve(parent):
            if answer.pin is not None:
                release = fx.ReleasePin(job_id=answer.pin.job_id, success=False)
                self._one(parent, (None, release), self._ground.clock())

    def _arm(self) -> None:
        if self._parked and self.deadline is None:
            ground = self._ground
            self.deadline = ground.clock() + ground.config.timings.pending_poll_interval
            ground.timers.arm(self)

    def serve(self, parent: Parent) -> list[Answered]:
        """Run the parked, then the queued requests against ``parent`` (lent: any thread).

        Returns:
            The answers, for the node to step on its own thread.
        """
        now = self._ground.clock()
        asked, self._parked = self._parked, []
        answers: list[Answered] = []
        while asked or self._queue:  # the node's thread may append to the queue meanwhile
            answer = self._one(parent, asked.pop() if asked else self._queue.popleft(), now)
            if answer is not None:
                answers.append(answer)
        return answers

    def _one(self, parent: Parent, item: _Item, now: float) -> Answered | None:
        """Serve one request: the answer a lookup gets now, if any (else it is parked)."""
        actor, request = item
        node = self._ground.config.node_id
        match request:
            case fx.ParentLookup(keys=keys):
                assert actor is not None
                if not _wanted(actor, request):
                    # Dropped (the peer closed the request) or answered at its
                    # deadline: don't ask the parent, don't pin.
                    return actor, inp.ParentAnswer(lookup_id=request.lookup_id, expired=True)
                # The pinned-blocks quota is checked here, where pins are made, so
                # that no path (first lookups, re-polls of keys that were pending)
                # can take a peer over it.
                peer = actor.id.peer
                budget = self._quotas.pin_budget(peer)
                refusal = self._quotas.pin_refusal(peer) if budget < len(keys) else ""
                answer = serve_parent_request(
                    parent, request, now, pin_budget=budget, refusal=refusal
                )
                if answer.pin is not None:
                    self._quotas.pinned(peer, answer.pin.job_id, len(answer.pin.blocks))
                if not _no_news(request, answer):
                    return actor, answer
                self._parked.append(item)  # nothing new: asked again later
            case fx.ParentClose(context):
                with _guarded(f"failed to finish {context}", context, node=node):
                    parent.on_request_finished(context)
            case fx.ReleasePin(job_id=job_id, success=success):
                self._quotas.released(job_id)
                with _guarded(f"failed to release job {job_id}", node=node):
                    parent.release_job(job_id, success=success)
        return None


def _wanted(actor: RequestActor, request: fx.ParentLookup) -> bool:
    """Whether the actor still waits for this lookup's answer (any thread)."""
    state = actor.state
    if not isinstance(state, ProducerState) or actor.done:
        return False
    lookup = state.lookups.get(request.lookup_id)
    return lookup is not None and not (lookup.dropped or lookup.answered)


def _no_news(request: fx.ParentLookup, answer: inp.ParentAnswer) -> bool:
    """A re-poll that resolved nothing and has time left: keep it parked."""
    if request.open_context or answer.expired or answer.pin is not None:
        return False
    pending = (LookupResult.HIT_PENDING, LookupResult.RETRY)
    return all(result in pending for _, result in answer.results)
