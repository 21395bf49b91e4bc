"""An automatic lookup, followed from its answers to the end of its fetches.

A peer chosen from its summary is scored on what its claims were worth
(:meth:`~p2pactor.core.sources.SourceIndex.score`): a claimed key it answered
MISS for is false at once; a key it answered HIT for counts as held only once
the request is over and no fetch of it failed by the peer's deed (the peer
reported the transfer failed, it never reported it, or its session went
down). A peer that answers HIT to everything and then fails every fetch is
as false as one that answers MISS; and a few failed fetches in a row
quarantine it whatever its precision (``ChoicePolicy.max_failed_fetches``). A load the
engine gave up first (it finished the request while the load was in flight)
says nothing of the peer.
"""

from __future__ import annotations

from collections.abc import Iterable

from p2pactor.core import events as ev

__all__ = ["AutoProbe"]


class AutoProbe:
    """A lookup the directory chose: its claimed keys, then what came of its hits.

    Args:
        peer: The chosen peer.
        claimed: The keys asked that its summary claimed.
    """

    __slots__ = (
        "answered",
        "claimed",
        "counted",
        "delivered",
        "ended",
        "failed",
        "failed_jobs",
        "fetched",
        "held",
        "peer",
    )

    def __init__(self, peer: str, claimed: tuple[bytes, ...]) -> None:
        self.peer = peer
        self.claimed = claimed
        self.answered = False
        self.held = 0  # claimed keys answered HIT
        self.counted = 0  # claimed keys that are scored (a quota's refusals are not)
        self.fetched: dict[int, int] = {}  # fetches out: job -> keys
        self.failed = 0  # keys of fetches the peer failed
        self.failed_jobs = 0  # and those fetches
        self.delivered = 0  # fetches it delivered
        self.ended = False

    def follow(self, events: Iterable[ev.AnyEvent]) -> None:
        """Take in the request's new events: its fetches and how they ended."""
        fetched = self.fetched
        for event in events:
            match event:
                case ev.FetchSent(job_id=job, keys=keys):
                    fetched[job] = len(keys)
                case ev.TransferDone(job_id=job, success=True):
                    self.delivered += job in fetched
                    fetched.pop(job, None)
                case (
                    ev.TransferDone(job_id=job) | ev.Aborted(job_id=job) | ev.AbortAcked(job_id=job)
                ):
                    if job in fetched:
                        self.failed += fetched.pop(job)
                        self.failed_jobs += 1
                case ev.FinishRequested():
                    fetched.clear()  # the engine gave up its loads: not the peer's doing
                case ev.Finished():
                    self.ended = True
                case _:
                    pass

    @property
    def held_by_deed(self) -> int:
        """The claimed keys that turned out held: answered HIT, and no fetch of them failed."""
        return max(0, self.held - self.failed)
