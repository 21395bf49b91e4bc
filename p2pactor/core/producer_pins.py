"""Releasing pins: every :class:`~p2pactor.core.events.PinReleased` is decided here.

A pin is released exactly once, and only a release that ends a round its job
served with no failure counts as a success.
"""

from __future__ import annotations

from p2pactor.core import events as ev
from p2pactor.core.producer_state import _B, PinJob, ProducerPhase, ProducerState
from p2pactor.core.timings import Timings

# How the reason of a :class:`~p2pactor.core.events.PinReleased` begins when the pin expired.
PIN_EXPIRED = "no fetch used it within"


def pin_expired(event: ev.PinReleased) -> bool:
    """Whether ``event`` released a pin because no fetch came for it in time."""
    return event.reason.startswith(PIN_EXPIRED)


def _release(b: _B, job_id: int, reason: str, *, served: bool = False) -> None:
    """Release ``job_id``: a success only if it ``served`` and no round it served failed.

    A job the state does not hold (a stray pin) is released too: it must not leak.
    """
    job = b.state.jobs.get(job_id)
    success = served and job is not None and not job.failed
    b.emit(ev.PinReleased(**b.head, job_id=job_id, success=success, reason=reason))


def _release_round_jobs(
    b: _B, round_seq: int, reason: str, *, served: bool = False, idle_only: bool = False
) -> None:
    for job_id, job in sorted(b.state.jobs.items()):
        if job.round_seq == round_seq and not (idle_only and job.readers):
            _release(b, job_id, reason, served=served)


def _expirable(s: ProducerState, job: PinJob) -> bool:
    """A pin no fetch is using or about to use: it may time out."""
    if job.readers or job.serving:
        return False
    if job.round_seq is None:
        return True
    rnd = s.rounds.get(job.round_seq)
    return rnd is None or not rnd.fetched


def _expire_pins(b: _B, t: Timings) -> None:
    for job_id, job in sorted(b.state.jobs.items()):
        if b.now >= job.expires_at and _expirable(b.state, job):
            _release(b, job_id, f"{PIN_EXPIRED} {t.pin_timeout:g} s")


def _release_stores(b: _B) -> None:
    """Release each store job once its rounds settled it or the request ended."""
    s = b.state
    in_pool = {sup.job_id for entries in s.pool.values() for sup in entries}
    # Once the engine stored its last block and every fetch so far was served,
    # leftover stored blocks can serve nobody.
    served_out = s.finishing and s.closed_through >= 0 and not s.rounds
    for job_id, job in sorted(s.jobs.items()):
        # A failed job's outcome is settled; a good one waits for its rounds.
        if job.round_seq is not None or job.readers or (job.serving and not job.failed):
            continue
        if job_id not in in_pool:
            _release(b, job_id, "all blocks served", served=True)
        elif s.phase is not ProducerPhase.OPEN:
            _release(b, job_id, s.close_reason)
        elif served_out:
            _release(b, job_id, "the engine finished and no fetch is waiting for these blocks")
