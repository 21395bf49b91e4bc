"""A NIXL transport's writes: started, posted, polled (see :mod:`p2pactor.adapters.nixl`)."""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable, Sequence
from logging import WARNING
from typing import Any

import attrs
import numpy as np
import trio

from p2pactor.adapters._nixl_agent import Agent, Index, Pool, Posted, nixl_error
from p2pactor.adapters._nixl_options import Tally, log, note
from p2pactor.runtime.transport import TransferError, WriteDone

_RATE_WEIGHT = 0.25  # of the newest post in the moving average of post times
_IN_PROGRESS = frozenset({"PROC", "PEND"})


@attrs.define(eq=False)
class Peer:
    """One registered peer name (several may share one remote agent)."""

    peer_id: str
    num_blocks: int
    base_addr: int  # of its pool: to prepare its list again (see NixlDataTransport._reload)
    remote: str | None = None  # NIXL's name for the peer's agent, once added
    dlist: object | None = None  # the peer's prepared descriptor list (one strided row)
    ready: trio.Event = attrs.field(factory=trio.Event)  # the add finished, either way
    removing: bool = False
    writes: set[_Write] = attrs.field(factory=set)  # started and not over


@attrs.define(eq=False)
class _Write:
    """One write, from validation to its terminal state."""

    peer: Peer
    local: Index
    remote: Index
    nbytes: int
    deadline: float  # on trio's clock: cancelled through NIXL if still running then
    done: WriteDone  # told the outcome exactly once, by _end (it is over once not in peer.writes)
    handle: object | None = None  # NIXL's transfer handle while it is in flight
    expired: str | None = None  # why it stopped being waited for, once it did
    zombie: bool = False


class Writes(Pool):
    """A NIXL transport's writes: the part of ``NixlDataTransport`` that moves bytes."""

    def __init__(self, *pool: Any) -> None:  # Pool's arguments
        super().__init__(*pool)
        self._lock = trio.Lock()  # held around every call into the agent (but see start_write)
        self._peers: dict[str, Peer] = {}
        self._inflight: list[_Write] = []  # posted, polled by the pump
        self._to_post: deque[_Write] = deque()  # waiting for the poster task
        self._kick = trio.Event()  # new work for the pump
        self._post_kick = trio.Event()  # new work for the poster
        self._expected = 0  # peers' writes into our pool that may be running
        self._wireup_until = -math.inf  # progress for peers' connection setup until then
        self._changed = trio.Event()  # some write ended or a peer was settled
        self._closing = False
        self._tally = Tally()  # what it counts
        self._post_rate: float | None = None  # seconds per byte of posts, moving average

    # --- posting ----------------------------------------------------------------------

    def start_write(
        self,
        peer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        done: WriteDone,
    ) -> None:
        """Start one NIXL WRITE of our ``local_blocks`` into the peer's ``remote_blocks``.

        Never blocks. ``done`` is told the outcome exactly once, on the trio
        thread (possibly before this returns): None once NIXL reports every
        byte written; otherwise why not, once NIXL reports the write over or
        has released (cancelled) it. The peer and the indexes are checked
        before NIXL is asked anything.
        """
        try:
            peer, local, remote = self._checked(peer_id, local_blocks, remote_blocks)
        except TransferError as exc:
            _tell(done, str(exc))
            return
        if not len(local):
            _tell(done, None)
            return
        deadline = trio.current_time() + self._options.transfer_timeout
        write = _Write(peer, local, remote, len(local) * self.block_len, deadline, done)
        peer.writes.add(write)
        # With the lock free no worker thread is in the agent, and none can enter
        # before this returns: nothing here lets another trio task run. Held, the
        # write queues behind the worker thread's call.
        if not self._to_post and self._quick(write) and not self._lock.locked():
            self._post_inline(self._live_agent(), write)
            return
        self._to_post.append(write)
        self._post_kick.set()

    def _checked(
        self, peer_id: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> tuple[Peer, Index, Index]:
        self._live_agent()  # or the transport is closed
        peer = self._peers.get(peer_id)
        if peer is None or peer.removing or peer.dlist is None:
            raise TransferError(f"{peer_id} is not registered")
        if len(local_blocks) != len(remote_blocks):
            raise TransferError(
                f"{len(local_blocks)} local blocks but {len(remote_blocks)} remote blocks"
            )
        local = _indexes(local_blocks, self.num_blocks, "local")
        return peer, local, _indexes(remote_blocks, peer.num_blocks, f"{peer_id}'s")

    def _quick(self, write: _Write) -> bool:
        """Whether ``inline_post_budget`` lets the write be posted on the trio thread."""
        rate = self._post_rate
        return rate is not None and rate * write.nbytes <= self._options.inline_post_budget

    async def _poster(self) -> None:
        """Post queued writes in order."""
        while True:
            while not self._to_post:
                await self._post_kick.wait()
                self._post_kick = trio.Event()
            write = self._to_post.popleft()
            if trio.current_time() >= write.deadline:
                self._end(write, "timed out waiting to reach the NIXL agent", failed=False)
                continue
            async with self._lock:
                agent = self._agent
                if self._closing or agent is None:
                    self._end(write, "the NIXL transport is closed", failed=False)
                elif self._quick(write):
                    self._post_inline(agent, write)
                else:
                    args = (agent, write.local, write.peer.dlist, write.remote)
                    self._posted(agent, write, await trio.to_thread.run_sync(self._post, *args))

    def _post_inline(self, agent: Agent, write: _Write) -> None:
        """Post on the trio thread (no worker thread in the agent: see ``start_write``)."""
        self._tally.posted_inline += 1
        self._posted(agent, write, self._post(agent, write.local, write.peer.dlist, write.remote))

    def _posted(self, agent: Agent, write: _Write, posted: Posted) -> None:
        """Track a posted write (no checkpoint before this: nothing may lose the handle)."""
        if posted.seconds is not None:
            rate = posted.seconds / write.nbytes
            old = self._post_rate
            self._post_rate = rate if old is None else old + _RATE_WEIGHT * (rate - old)
        if posted.handle is None:
            self._end(write, posted.why)
            return
        write.handle = posted.handle
        self._inflight.append(write)
        self._kick.set()
        self._settle(agent, write, posted.state, posted.why)

    # --- the pump ---------------------------------------------------------------------

    async def _pump(self) -> None:
        """Poll writes in flight, and drive the agent's progress while a peer's may run.

        A peer's write into our pool may run with nobody else progressing it
        while one is expected or a connection is being set up, unless NIXL's
        progress thread runs (it wakes as the peer's bytes arrive).
        """
        intervals = self._options.poll_intervals()
        while True:
            kick = self._kick
            busy = bool(self._inflight)
            peers = self._expected > 0 or trio.current_time() < self._wireup_until
            interval = math.inf  # nothing to do: sleep until kicked
            if busy or (peers and not self._threaded):
                async with self._lock:
                    if self._poll_round():
                        intervals = self._options.poll_intervals()
                        continue
                interval = next(intervals) if busy else self._options.idle_poll_interval
            self._tally.idle = interval == math.inf
            if interval == 0:
                await trio.lowlevel.checkpoint()
            else:
                with trio.move_on_after(interval):
                    await kick.wait()
            self._tally.idle = False
            if kick.is_set():
                self._kick = trio.Event()
                intervals = self._options.poll_intervals()

    def _poll_round(self) -> bool:
        """Drive the agent's progress, check every write in flight once (lock held).

        Returns whether a write ended. Notifications are dropped: we attach
        none, and vLLM's tier sends none.
        """
        agent = self._agent
        if agent is None:
            return False
        self._tally.progress_polls += 1
        self._attempt("get_new_notifs", lambda a: a.get_new_notifs(), agent)
        ended = False
        now = trio.current_time()
        for write in list(self._inflight):
            if write.expired is None and now >= write.deadline:
                write.expired = f"no completion within {self._options.transfer_timeout:g} s"
            try:
                state = agent.check_xfer_state(write.handle)
            except Exception as exc:
                state, why = "ERR", nixl_error(exc)
            else:
                why = f"NIXL reported {state}"
            ended = self._settle(agent, write, state, why) or ended
        return ended

    def _settle(self, agent: Agent, write: _Write, state: str, why: str) -> bool:
        """End a write in flight NIXL says is over, or cancel one expired (lock held).

        ``state`` is NIXL's (``transfer()``'s or ``check_xfer_state``'s). Returns
        whether the write ended.
        """
        if state == "DONE":
            # The bytes are there: if NIXL keeps the handle, only the handle leaks.
            self._attempt("releasing a finished write", agent.release_xfer_handle, write.handle)
            late = write.expired
            self._end(write, f"{late}; it completed only afterwards" if late else None)
        elif state in _IN_PROGRESS:
            if write.expired is None or not self._release(agent, write):
                return False
            self._end(write, f"{write.expired}; NIXL cancelled it")
        elif self._release(agent, write):
            self._end(write, f"NIXL failed the write: {why}")
        else:
            return False
        return True

    def _release(self, agent: Agent, write: _Write) -> bool:
        """Release (cancel, if running) a write's handle. False: NIXL refused."""
        try:
            agent.release_xfer_handle(write.handle)
        except Exception as exc:
            if not write.zombie:
                write.zombie = True
                peer, why = write.peer.peer_id, nixl_error(exc)
                what = "a write to %s cannot be released yet (%s); polling it until it ends"
                note(WARNING, self.agent_name, what, peer, why, peer=peer)
            return False
        return True

    def _end(self, write: _Write, error: str | None, *, failed: bool = True) -> None:
        """Record that ``write`` is over (no part of it can still run) and say so."""
        if write not in write.peer.writes:
            return  # over already
        write.peer.writes.remove(write)
        write.handle = None
        if write in self._inflight:
            self._inflight.remove(write)
        if error is None:
            self._tally.writes_done += 1
            self._tally.bytes_written += write.nbytes
        elif failed:
            self._tally.writes_failed += 1
        self._signal()
        _tell(write.done, error)

    # --- helpers ----------------------------------------------------------------------

    def _live_agent(self) -> Agent:
        if self._agent is None or self._closing:
            raise TransferError("the NIXL transport is closed")
        return self._agent

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds: a checkpoint even if it already does."""
        if condition():
            await trio.lowlevel.checkpoint()
        while not condition():
            await self._changed.wait()


def _tell(done: WriteDone, error: str | None) -> None:
    try:
        done(error)
    except Exception:
        # The caller's bug must not stop the pump (every other write).
        log.exception(
            "a write's completion callback failed (a bug in p2pactor: please report it with "
            "this traceback)"
        )


def _indexes(blocks: Sequence[int], limit: int, whose: str) -> Index:
    """``blocks`` as NIXL's int32 index array, each checked to be in ``[0, limit)``."""
    try:
        values = [operator.index(b) for b in blocks]
    except TypeError:
        raise TransferError(f"{whose} block indexes must be ints") from None
    bad = next((b for b in values if not 0 <= b < limit), None)
    if bad is not None:
        raise TransferError(f"{whose} block index {bad} is out of range (0..{limit - 1})")
    return np.array(values, dtype=np.int32)
