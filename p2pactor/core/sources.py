"""Which peers claim which keys, and the choice of a source for a request that names none.

Each p2pactor peer tells us, over its session, the keys its engine's CPU tier
holds: sequenced deltas of 64-bit fingerprints (:func:`fingerprint`), and
snapshots (in parts) on session ready, on a gap and now and then.
:class:`SourceIndex` folds them into one inverted index, fingerprint -> the
peers that claim it, keeps per peer its epoch, its sequence and how often its
claims held when probed, and chooses, for a request's keys in order, the peer
worth one lookup.

Sans-IO like :mod:`p2pactor.core.stores`: no I/O, no clock (``now`` is an
argument), and every method returns what the runtime must do, as data (a
:class:`Resync` to send, a :class:`Choice` to record and act on). A peer's
claims only steer performance: a false claim costs one lookup that answers
MISS, never wrong bytes, and a peer whose claims keep missing is quarantined
for automatic choice (it stays usable as a source a request names).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import msgspec

from p2pactor.core.choice import Choice, ChoicePolicy, Claim

__all__ = ["BYTES_PER_CLAIM", "Resync", "SourceIndex", "fingerprint"]

_MASK64 = (1 << 64) - 1
_GROUP_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads group indexes over all bits


def fingerprint(key: bytes) -> int:
    """The 64-bit fingerprint a summary carries for an offload key.

    vLLM's key is the block hash followed by a 4-byte big-endian KV-cache group
    index. The fingerprint is the hash's low 64 bits (what vLLM's KV events
    publish as an int hash) mixed with the group, so group 0 keeps them as they
    are. A key shorter than 12 bytes (never one of vLLM's) counts as if
    zero-padded in front.
    """
    low = int.from_bytes(key[-12:-4], "big")
    group = int.from_bytes(key[-4:], "big")
    return low ^ ((group * _GROUP_MIX) & _MASK64)


class Resync(msgspec.Struct, frozen=True, gc=False):
    """Ask ``peer`` for a snapshot: its summary has a gap (or we have none)."""

    peer: str
    epoch: bytes
    from_seq: int


MAX_BUFFERED_DELTAS = 256
"""Deltas kept while a snapshot is assembled; past that the snapshot is given up."""
BYTES_PER_CLAIM = 512
"""What one claim a peer may make costs this node, at most: the claim (280 to
310 bytes measured with ``tracemalloc`` for a fingerprint only that peer
claims: the index's dict entry, its set and the peer's set), its place in a
snapshot being assembled (about 110) and in the deltas buffered meanwhile
(up to two fingerprints a claim, about 80). A node's budget for a peer
divided by this is how many claims it keeps."""
BUFFERED_SLACK = 64
"""Fingerprints buffered during a snapshot past twice the peer's capacity: none."""
RESYNC_AFTER_DELTAS = 64
"""Deltas a gap may last before its resync is asked again (the first may be lost)."""
MAX_QUARANTINE_DOUBLINGS = 32
"""Quarantines counted for the back-off (it reached its cap long before)."""


class _Assembly:
    """A snapshot being put together from its parts."""

    __slots__ = ("buffered", "buffered_fps", "cut", "fps", "parts", "seen", "upto")

    def __init__(self, upto: int, parts: int) -> None:
        self.upto = upto
        self.parts = parts
        self.seen: set[int] = set()
        self.fps: set[int] = set()
        # Deltas after ``upto`` that came meanwhile: applied once it is whole.
        self.buffered: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self.buffered_fps = 0  # fingerprints in ``buffered``
        self.cut = False  # it claimed more than it may: cut back to its capacity


class _Peer:
    """One peer's summary and record (mutable: the index owns it alone)."""

    __slots__ = (
        "assembly",
        "capacity",
        "claims",
        "epoch",
        "failed_fetches",
        "gap_deltas",
        "in_flight",
        "precision",
        "probed",
        "quarantined_until",
        "quarantines",
        "resync_asked",
        "seq",
        "strikes",
        "synced",
    )

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.epoch = b""
        self.seq = 0
        self.synced = False  # a whole snapshot arrived for this epoch
        self.resync_asked = False  # a Resync is out and no snapshot came since
        self.gap_deltas = 0  # deltas the gap has lasted since the resync was asked
        self.claims: set[int] = set()
        self.assembly: _Assembly | None = None
        self.precision = 1.0
        self.probed = 0
        self.strikes = 0
        self.in_flight = 0
        self.failed_fetches = 0  # in a row
        self.quarantines = 0
        self.quarantined_until = 0.0


class SourceIndex:
    """Every peer's claims, as one index, and the choice of a source per request.

    What a peer sends costs work in proportion to the message, and memory
    within the blocks it registered (a snapshot that never completes is given
    up); a peer that claims more than it may is truncated and struck.

    Args:
        policy: How claims are trusted and when a lookup is worth it.
    """

    def __init__(self, policy: ChoicePolicy | None = None) -> None:
        self.policy = policy or ChoicePolicy()
        self._peers: dict[str, _Peer] = {}
        self._holders: dict[int, set[str]] = {}
        # The quarantined peers, replaced whole (read by engine threads): a
        # key only they claim is unclaimed, a MISS with no wait.
        self._excluded: frozenset[str] = frozenset()

    # --- what the index holds ---------------------------------------------------------

    @property
    def peers(self) -> tuple[str, ...]:
        """The peers with a summary here, in the order they came."""
        return tuple(self._peers)

    def __len__(self) -> int:
        """Distinct fingerprints claimed by any peer."""
        return len(self._holders)

    def claimed_by(self, fp: int) -> frozenset[str]:
        """The peers that claim ``fp``."""
        return frozenset(self._holders.get(fp, ()))

    def claimed(self, fp: int) -> bool:
        """Whether any peer not quarantined claims ``fp``. Safe from another thread.

        One dict lookup while no peer is quarantined. Otherwise the holders
        are compared with the quarantined; a set the node's thread changes
        meanwhile counts as claimed (the node's choice then decides).
        """
        holders = self._holders.get(fp)
        if not holders:
            return False
        excluded = self._excluded
        if not excluded:
            return True
        try:
            return not holders <= excluded
        except RuntimeError:  # changed size under us
            return True

    def next_release(self) -> float | None:
        """When the first quarantine ends (None: no peer is quarantined)."""
        peers = self._peers
        ends = [peers[p].quarantined_until for p in self._excluded if p in peers]
        return min(ends, default=None)

    def release(self, now: float) -> None:
        """End the quarantines that are over at ``now``: their claims count again."""
        if self._excluded:
            peers = self._peers
            self._excluded = frozenset(
                p for p in self._excluded if p in peers and now < peers[p].quarantined_until
            )

    def claims_of(self, peer: str) -> int:
        """How many fingerprints ``peer`` claims."""
        found = self._peers.get(peer)
        return len(found.claims) if found is not None else 0

    def position(self, peer: str) -> tuple[bytes, int, bool] | None:
        """``peer``'s epoch, last sequence and whether a whole snapshot arrived."""
        found = self._peers.get(peer)
        return None if found is None else (found.epoch, found.seq, found.synced)

    def precision(self, peer: str) -> float:
        """How often ``peer``'s probed claims held (a moving average; 1.0 before any)."""
        found = self._peers.get(peer)
        return found.precision if found is not None else 1.0

    def strikes(self, peer: str) -> int:
        """Messages of ``peer`` that claimed more than it may (truncated or refused)."""
        found = self._peers.get(peer)
        return found.strikes if found is not None else 0

    def quarantined(self, peer: str, now: float) -> bool:
        """Whether automatic choice skips ``peer`` at ``now``."""
        found = self._peers.get(peer)
        return found is not None and now < found.quarantined_until

    # --- membership -----------------------------------------------------------------

    def add_peer(self, peer: str, capacity: int) -> Resync:
        """A session with ``peer`` is ready: it may claim at most ``capacity`` keys.

        Returns the snapshot request to send (a peer sends one on session ready
        anyway; asking costs nothing and covers a lost one). A peer added again
        (a new session) keeps its summary until its epoch says otherwise; the
        probes of its old session are over.
        """
        found = self._peers.get(peer)
        if found is None:
            found = self._peers[peer] = _Peer(capacity)
        else:
            found.capacity = capacity
            found.in_flight = 0
            if len(found.claims) > capacity:
                self._cut(peer, found, found.claims)
        found.resync_asked, found.gap_deltas = True, 0
        return Resync(peer, found.epoch, found.seq + 1 if found.synced else 0)

    def remove_peer(self, peer: str) -> None:
        """``peer`` is gone (its session ended): forget its claims."""
        found = self._peers.pop(peer, None)
        if found is not None:
            self._drop_claims(peer, found.claims)
            self._excluded = self._excluded - {peer}

    # --- summaries --------------------------------------------------------------------

    def delta(
        self, peer: str, epoch: bytes, seq: int, add: Sequence[int], remove: Sequence[int]
    ) -> Resync | None:
        """Apply ``peer``'s delta number ``seq``; a Resync to send if it shows a gap."""
        found = self._peers.get(peer)
        if found is None:
            return None  # no session: nothing to keep it for
        if epoch != found.epoch:
            # A restarted peer: its old summary goes whole, its new one starts
            # with a snapshot (asked once, however often the epoch flips).
            asked = found.resync_asked
            self._new_epoch(peer, found, epoch)
            found.resync_asked = True
            return None if asked else Resync(peer, epoch, 0)
        assembly = found.assembly
        if assembly is not None and seq > assembly.upto:
            size = assembly.buffered_fps + len(add) + len(remove)
            most = 2 * found.capacity + BUFFERED_SLACK
            if len(assembly.buffered) >= MAX_BUFFERED_DELTAS or size > most:
                # It is not coming whole, or the deltas meanwhile weigh more than
                # twice the claims the peer may make: give it up, ask again below.
                found.strikes += size > most
                found.assembly = None
                found.resync_asked = False
            else:
                assembly.buffered.append((seq, tuple(add), tuple(remove)))
                assembly.buffered_fps = size
        if seq <= found.seq:
            return None  # already folded in (a snapshot covered it)
        if seq == found.seq + 1 and found.synced:
            found.seq = seq
            self._apply(peer, found, add, remove)
            return None
        # A gap (or no snapshot yet): ask once, and again if it lasts.
        found.gap_deltas += 1
        if found.resync_asked and found.gap_deltas < RESYNC_AFTER_DELTAS:
            return None
        found.resync_asked, found.gap_deltas = True, 0
        return Resync(peer, epoch, found.seq + 1 if found.synced else 0)

    def snapshot(
        self,
        peer: str,
        epoch: bytes,
        upto_seq: int,
        *,
        part: int,
        parts: int,
        fps: Sequence[int],
    ) -> Resync | None:
        """Apply part ``part`` of ``parts`` of ``peer``'s snapshot as of ``upto_seq``.

        The claims change only when the last missing part arrives: they become
        the snapshot's keys, then every delta after ``upto_seq`` that came
        meanwhile, in order. A part older than what is held or assembled is
        dropped; a newer snapshot replaces the one being assembled. Returns a
        Resync if the deltas after it have a gap.
        """
        found = self._peers.get(peer)
        if found is None or not 0 <= part < parts:
            return None
        if parts > found.capacity + 1:
            found.strikes += 1  # more parts than keys it may claim: never whole
            return None
        if epoch != found.epoch:
            self._new_epoch(peer, found, epoch)
        assembly = found.assembly
        if assembly is not None and upto_seq < assembly.upto:
            return None  # an older snapshot's part: the newer one is being assembled
        if assembly is None or upto_seq > assembly.upto or parts != assembly.parts:
            if found.synced and upto_seq < found.seq:
                return None  # a new snapshot older than what deltas already brought
            kept = [] if assembly is None else [b for b in assembly.buffered if b[0] > upto_seq]
            assembly = found.assembly = _Assembly(upto_seq, parts)
            assembly.buffered = kept
            assembly.buffered_fps = sum(len(add) + len(remove) for _, add, remove in kept)
        if part in assembly.seen:
            return None
        assembly.seen.add(part)
        held = assembly.fps
        room = found.capacity - len(held)
        if len(fps) <= room:
            held.update(fps)
        else:
            # More than it may claim (what it registered, or this node's budget
            # for it): keep what fits, strike it once a snapshot. Never more
            # than that enters the set: a set does not shrink.
            held.update(itertools.islice((fp for fp in fps if fp not in held), max(0, room)))
            found.strikes += not assembly.cut
            assembly.cut = True
        if len(assembly.seen) < parts:
            return None
        found.assembly = None
        keys = assembly.fps
        self._drop_claims(peer, found.claims - keys)
        self._add_claims(peer, keys - found.claims)
        found.claims = keys
        found.seq, found.synced = upto_seq, True
        found.resync_asked, found.gap_deltas = False, 0
        for seq, add, remove in sorted(assembly.buffered):
            if seq == found.seq + 1:
                found.seq = seq
                self._apply(peer, found, add, remove)
        if any(seq > found.seq for seq, _, _ in assembly.buffered):
            found.resync_asked = True  # a delta after it was lost
            return Resync(peer, epoch, found.seq + 1)
        return None

    def missed(self, peer: str, fps: Iterable[int]) -> None:
        """``peer`` answered MISS for keys it claimed: it no longer holds them."""
        found = self._peers.get(peer)
        if found is not None:
            gone = found.claims.intersection(fps)
            found.claims -= gone
            self._drop_claims(peer, gone)

    # --- choosing a source ------------------------------------------------------------

    def choose(self, fps: Sequence[int], now: float) -> Choice:
        """The peer to look up for a request whose keys are ``fps``, in order."""
        if not fps:
            return Choice(None, 0, (), "no keys")
        self.release(now)
        first = self._holders.get(fps[0])
        if not first:
            return Choice(None, 0, (), "no peer claims the first key")
        policy = self.policy
        claims = []
        for peer in first:
            found = self._peers[peer]
            if now < found.quarantined_until or found.in_flight >= policy.max_probes_per_peer:
                continue
            run = 1
            while run < len(fps) and peer in self._holders.get(fps[run], ()):
                run += 1
            saved = run * policy.tokens_per_key * policy.prefill_s_per_token
            score = saved * found.precision - policy.round_trip_s - policy.load_s * found.in_flight
            claims.append(Claim(peer, run, found.precision, score))
        if not claims:
            return Choice(None, 0, (), "every peer claiming the first key is quarantined or busy")
        claims.sort(key=lambda c: (-c.score, -c.run, c.peer))
        best = claims[0]
        if best.score <= 0:
            return Choice(None, 0, tuple(claims), "no claimed run is worth a round trip")
        keys = min(len(fps), best.run + policy.tail_keys)
        reason = f"longest worthwhile run: {best.run} of {len(fps)} keys"
        return Choice(best.peer, keys, tuple(claims), reason)

    def probe_started(self, peer: str) -> None:
        """An automatic lookup to ``peer`` was sent."""
        found = self._peers.get(peer)
        if found is not None:
            found.in_flight += 1

    def probe_ended(self, peer: str, claimed: int, hits: int, now: float) -> None:
        """An automatic lookup to ``peer`` ended: ``hits`` of the ``claimed`` keys it asked held.

        :meth:`probe_answered`, then :meth:`score`.
        """
        self.probe_answered(peer)
        self.score(peer, claimed, hits, now)

    def probe_answered(self, peer: str) -> None:
        """An automatic lookup to ``peer`` has its answers (or never will): no longer in flight."""
        found = self._peers.get(peer)
        if found is not None:
            found.in_flight = max(0, found.in_flight - 1)

    def score(self, peer: str, claimed: int, held: int, now: float) -> None:
        """``held`` of ``claimed`` keys ``peer`` claimed turned out held (by answer and deed).

        A failed lookup (no answer) is ``held=0``; so is a HIT whose fetch the
        peer then failed. Updates the peer's precision and quarantines it when
        too few of its claims hold. Scores that come during a quarantine count
        for nothing: the burst that caused it is one quarantine, not several.
        """
        found = self._peers.get(peer)
        if found is None or claimed <= 0 or now < found.quarantined_until:
            return
        policy = self.policy
        keep = (1.0 - policy.precision_weight) ** claimed
        share = max(0, min(held, claimed)) / claimed
        found.precision = found.precision * keep + share * (1.0 - keep)
        found.probed += claimed
        if found.probed >= policy.min_probed_keys and found.precision < policy.min_precision:
            self._quarantine(peer, found, now)

    def fetches_ended(self, peer: str, *, delivered: int, failed: int, now: float) -> None:
        """Fetches of ``peer``'s hits for one request ended: ``delivered`` did, ``failed`` not.

        Besides the precision (:meth:`score`): a peer whose fetches keep
        failing is quarantined after ``max_failed_fetches`` in a row, however
        few keys each carried.
        """
        found = self._peers.get(peer)
        if found is None or now < found.quarantined_until:
            return
        if delivered:
            found.failed_fetches = 0
        found.failed_fetches += failed
        if found.failed_fetches >= self.policy.max_failed_fetches:
            self._quarantine(peer, found, now)

    def _quarantine(self, peer: str, found: _Peer, now: float) -> None:
        policy = self.policy
        doublings = min(found.quarantines, MAX_QUARANTINE_DOUBLINGS)
        span = min(policy.max_quarantine_s, policy.quarantine_s * 2.0**doublings)
        found.quarantines += 1
        found.quarantined_until = now + span
        self._excluded = self._excluded | {peer}
        # After the quarantine it starts over, with the back-off remembered.
        found.precision, found.probed, found.failed_fetches = 1.0, 0, 0

    # --- the index itself -------------------------------------------------------------

    def _new_epoch(self, peer: str, found: _Peer, epoch: bytes) -> None:
        # A resync asked stays asked: it is answered with the peer's epoch of
        # the moment, whichever that is, and one that flips its epoch on every
        # message would otherwise have each of them ask another.
        self._drop_claims(peer, found.claims)
        found.claims = set()
        found.epoch, found.seq, found.synced = epoch, 0, False
        found.assembly, found.gap_deltas = None, 0

    def _apply(self, peer: str, found: _Peer, add: Iterable[int], remove: Iterable[int]) -> None:
        gone = found.claims.intersection(remove)
        found.claims -= gone
        self._drop_claims(peer, gone)
        new = set(add) - found.claims
        room = found.capacity - len(found.claims)
        if len(new) > room:
            # More than it registered blocks for: keep what fits (work in
            # proportion to the message, never to the whole summary).
            found.strikes += 1
            new = set(itertools.islice(new, max(0, room)))
        found.claims |= new
        self._add_claims(peer, new)

    def _cut(self, peer: str, found: _Peer, claims: set[int]) -> None:
        """Keep ``capacity`` of a peer's claims (its capacity went down)."""
        kept = set(itertools.islice(claims, found.capacity))
        self._drop_claims(peer, claims - kept)
        found.claims = kept
        found.strikes += 1

    def _add_claims(self, peer: str, fps: Iterable[int]) -> None:
        holders = self._holders
        for fp in fps:
            found = holders.get(fp)
            if found is None:
                holders[fp] = {peer}
            else:
                found.add(peer)

    def _drop_claims(self, peer: str, fps: Iterable[int]) -> None:
        holders = self._holders
        for fp in fps:
            found = holders.get(fp)
            if found is not None:
                found.discard(peer)
                if not found:
                    del holders[fp]
