"""The parent: the engine's own block cache, as a producer sees it.

A node serves its blocks out of the engine's cache, but never touches that cache
on its own schedule: it posts *parent requests* (see
:class:`~p2pactor.core.effects.ParentLookup`) and the engine lets them run while it
lends the cache (``Node.serve_parent``), or, for an in-process cache, the node
serves them as they come. :class:`Parent` is what the node needs of the cache;
:class:`EmbeddedCache` is a complete in-process implementation (a block pool with
pinning, HIT_PENDING and eviction) used by the demo and the tests.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from p2pactor.core import inputs as inp
from p2pactor.core.inputs import LookupResult
from p2pactor.errors import P2PActorError


class Parent(Protocol):
    """The engine's cache, as far as a node needs it.

    Every method is called synchronously, only while the engine lends the cache,
    never concurrently. The node promises: every synthetic request opened with
    :meth:`on_new_request` gets exactly one :meth:`on_request_finished`, and
    every job from :meth:`create_store_job` gets exactly one :meth:`release_job`.
    """

    def on_new_request(self, context: str) -> None:
        """A synthetic request named ``context`` starts (one per lookup)."""

    def lookup(self, key: bytes, context: str) -> LookupResult:
        """Whether the cache holds ``key``: HIT, MISS, HIT_PENDING or RETRY."""

    def create_store_job(self, keys: Sequence[bytes], context: str) -> inp.Pin:
        """Pin the blocks of ``keys`` (all HITs just now) as one job."""

    def on_request_finished(self, context: str) -> None:
        """The synthetic request ``context`` is over."""

    def release_job(self, job_id: int, *, success: bool) -> None:
        """Unpin the blocks of ``job_id``; ``success`` says whether they served a fetch."""


class ParentMisuse(P2PActorError):
    """The cache was asked something its contract forbids (a double release...)."""


class CacheFull(P2PActorError):
    """Every block is pinned; nothing can be evicted to make room."""


class EmbeddedCache:
    """An in-process block cache implementing :class:`Parent`.

    Blocks live in one ``bytearray`` (``memory``) that a data transport can
    register. Keys map to blocks; pinned blocks are never evicted; a key can
    be *pending* (HIT_PENDING: being written) before it is stored. Least
    recently used unpinned blocks are evicted when a new key needs room.

    Args:
        num_blocks: Blocks in the pool.
        block_len: Bytes per block.
        memory: The pool to use (a writable buffer of ``num_blocks *
            block_len`` bytes, e.g. ``memoryview(tensor.numpy())`` of a torch
            tensor a data transport registers); by default a new bytearray.

    Attributes:
        memory: The block pool, ``num_blocks * block_len`` bytes.
        opened: Synthetic requests opened and not yet finished.
        finished: How many times each synthetic request was finished.
    """

    def __init__(
        self, num_blocks: int, block_len: int, memory: bytearray | memoryview | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.block_len = block_len
        size = num_blocks * block_len
        if memory is None:
            memory = bytearray(size)
        elif isinstance(memory, memoryview):
            memory = memory.cast("B")
        if len(memory) != size or memoryview(memory).readonly:
            raise ValueError(f"memory must be a writable buffer of exactly {size} bytes")
        self.memory = memory
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> block, LRU order
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pending: set[bytes] = set()
        self._pins: Counter[int] = Counter()
        self._jobs: dict[int, tuple[int, ...]] = {}
        self._job_ids = itertools.count(1)
        self.opened: set[str] = set()
        self.finished: Counter[str] = Counter()
        self.released: Counter[int] = Counter()
        self._came: Callable[[bytes], None] | None = None
        self._went: Callable[[bytes], None] | None = None

    # --- the engine's side -------------------------------------------------------

    def watch_keys(
        self, came: Callable[[bytes], None] | None, went: Callable[[bytes], None] | None
    ) -> None:
        """Call ``came(key)`` for each key stored from now on, ``went(key)`` for each evicted.

        ``came`` is called at once for every key already stored, so the
        watcher's copy is exact from the start (a node's summary of what it
        holds). Call from the node's thread; ``None, None`` stops.
        """
        self._came, self._went = came, went
        if came is not None:
            for key in self._index:
                came(key)

    def block_of(self, key: bytes) -> int | None:
        """The block holding ``key``, if stored."""
        return self._index.get(key)

    def read(self, key: bytes) -> bytes:
        """The bytes of ``key``'s block.

        Raises:
            KeyError: ``key`` is not stored.
        """
        block = self._index[key]
        return bytes(self.memory[block * self.block_len : (block + 1) * self.block_len])

    def mark_pending(self, key: bytes) -> None:
        """``key`` is being written: lookups answer HIT_PENDING until it is stored."""
        if key not in self._index:
            self._pending.add(key)

    def store(self, key: bytes, data: bytes) -> int:
        """Store ``data`` (exactly one block) under ``key`` and return its block.

        Raises:
            ValueError: ``data`` is not one block long.
            CacheFull: Every block is pinned.
        """
        if len(data) != self.block_len:
            raise ValueError(f"a block is {self.block_len} bytes, got {len(data)}")
        block = self._index.get(key)
        if block is None:
            block = self._allocate()
            self._add(key, block)
        self._index.move_to_end(key)
        self.memory[block * self.block_len : (block + 1) * self.block_len] = data
        return block

    def allocate(self, count: int) -> list[int]:
        """Reserve ``count`` blocks (pinned, unindexed) as destinations of a load.

        Raises:
            CacheFull: Not enough blocks can be freed.
        """
        blocks = [self._allocate() for _ in range(count)]
        self._pins.update(blocks)
        return blocks

    def commit(self, key: bytes, block: int) -> None:
        """A load into ``block`` (from :meth:`allocate`) finished: index it as ``key``.

        If ``key`` is stored already, the loaded copy is given back instead: the
        stored block may be pinned and read by a transfer right now.
        """
        self._unpin((block,))
        if key in self._index:
            self._free.append(block)
        else:
            self._add(key, block)

    def _add(self, key: bytes, block: int) -> None:
        """Index ``block`` as ``key`` (stored now: no longer pending)."""
        self._index[key] = block
        self._pending.discard(key)
        if self._came is not None:
            self._came(key)

    def free(self, blocks: Sequence[int]) -> None:
        """Give back blocks from :meth:`allocate` whose load failed."""
        self._unpin(blocks)
        self._free.extend(blocks)

    def pinned(self) -> int:
        """How many blocks are pinned right now."""
        return len(self._pins)

    def _unpin(self, blocks: Sequence[int]) -> None:
        pins = self._pins
        for block in blocks:
            pins[block] -= 1
            if pins[block] <= 0:
                del pins[block]

    def _allocate(self) -> int:
        if self._free:
            return self._free.pop()
        for key, block in self._index.items():  # least recently used first
            if self._pins[block] == 0:
                del self._index[key]
                if self._went is not None:
                    self._went(key)
                return block
        raise CacheFull(f"all {self.num_blocks} blocks are pinned; release some or grow the pool")

    # --- Parent ------------------------------------------------------------------

    def on_new_request(self, context: str) -> None:
        """Open a synthetic request."""
        if context in self.opened:
            raise ParentMisuse(f"synthetic request {context} opened twice")
        self.opened.add(context)

    def lookup(self, key: bytes, context: str) -> LookupResult:
        """HIT if stored, HIT_PENDING if being written, else MISS."""
        if context not in self.opened:
            raise ParentMisuse(f"lookup in {context}, which is not open")
        if key in self._index:
            return LookupResult.HIT
        if key in self._pending:
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    def create_store_job(self, keys: Sequence[bytes], context: str) -> inp.Pin:
        """Pin the blocks of ``keys`` as one job."""
        if context not in self.opened:
            raise ParentMisuse(f"pin in {context}, which is not open")
        return self.pin(keys)

    def pin(self, keys: Sequence[bytes]) -> inp.Pin:
        """Pin the blocks of stored ``keys`` as one job (release with :meth:`release_job`).

        The engine uses this for the blocks of a prefill/decode request it hands
        to ``Node.submit_store``.

        Raises:
            KeyError: A key is not stored.
        """
        blocks = tuple(self._index[k] for k in keys)
        job = next(self._job_ids)
        self._pins.update(blocks)
        self._jobs[job] = blocks
        return inp.Pin(job, tuple(keys), blocks)

    def on_request_finished(self, context: str) -> None:
        """Close a synthetic request."""
        if context not in self.opened:
            raise ParentMisuse(f"synthetic request {context} finished but not open")
        self.opened.discard(context)
        self.finished[context] += 1

    def release_job(self, job_id: int, *, success: bool) -> None:
        """Unpin a job's blocks."""
        blocks = self._jobs.pop(job_id, None)
        if blocks is None:
            raise ParentMisuse(f"job {job_id} released but not held (released twice?)")
        self.released[job_id] += 1
        self._unpin(blocks)

    def held_jobs(self) -> set[int]:
        """Jobs pinned and not released."""
        return set(self._jobs)
