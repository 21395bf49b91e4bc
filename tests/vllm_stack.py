"""Engines on vLLM 0.33's own offloading stack, with the tier's contract checked.

Each :class:`StackNode` is one engine: vLLM's ``TieringOffloadingManager``
built by its own ``get_manager()`` (:func:`~p2pactor.programs.vllmstack.build_stack`:
the CPU tier with vLLM's LRU, the tier-poll thread, the secondary tier made by
``SecondaryTierFactory`` from its entry), stepped by a
:class:`~p2pactor.programs.vllmstack.StackEngine` in the call pattern of vLLM's
``OffloadingConnectorScheduler``. Nothing here answers for vLLM: lookups,
promotions, stores and cascades are vLLM's code, over real ZeroMQ and NIXL.

What vLLM's own code does not check, the node checks by watching it, never
by standing in for it:

* the parent handle vLLM lends each tier (``manager._tier_parents[tier]``) is
  wrapped: a call outside ``serve_external_requests`` or without the manager
  lock is a violation, and every synthetic request the tier opens through it
  must be finished exactly once;
* every job vLLM registered is reported once by ``get_finished_jobs()`` (vLLM
  asserts that too, but on its tier-poll thread, where it only logs);
* a tier-poll round that raises is a failure (vLLM logs it and carries on);
* :meth:`StackNode.check`: no job in flight, no chunk of the CPU tier pinned
  or half-written, every synthetic request closed.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from p2pactor.programs.vllmstack import StackEngine, StackOptions, build_stack, tier_entry
from tests.ports import free_port

HOST = "127.0.0.1"
TIMEOUT = 60.0  # generous: 2 busy cores; every wait ends as soon as its condition holds
CHUNK_BYTES = 4096


class _CheckedParent:
    """vLLM's parent handle for one tier, with its contract watched (see the module)."""

    def __init__(self, node: StackNode, real: Any) -> None:
        self._node = node
        self._real = real
        self.lent = 0
        self.opened: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()

    def _enter(self, method: str, req_id: str) -> None:
        if not self.lent:
            self._node.violation(f"{method}({req_id}) outside serve_external_requests")
        if not self._node.stack.lock.locked():
            self._node.violation(f"{method}({req_id}) without the manager lock")

    def on_new_request(self, req_context: Any) -> Any:
        self._enter("on_new_request", req_context.req_id)
        self.opened[req_context.req_id] += 1
        return self._real.on_new_request(req_context)

    def lookup(self, key: Any, req_context: Any) -> Any:
        self._enter("lookup", req_context.req_id)
        if req_context.req_id not in self.opened:
            self._node.violation(f"lookup({req_context.req_id}) of a request never opened")
        return self._real.lookup(key, req_context)

    def create_store_job(self, keys: Any, req_context: Any) -> Any:
        self._enter("create_store_job", req_context.req_id)
        return self._real.create_store_job(keys, req_context)

    def on_request_finished(self, req_context: Any) -> None:
        self._enter("on_request_finished", req_context.req_id)
        self.finished[req_context.req_id] += 1
        self._real.on_request_finished(req_context)

    def open_requests(self) -> set[str]:
        return {r for r, n in self.opened.items() if self.finished[r] < n}


class StackNode:
    """One engine on vLLM's stack with p2pactor's tier (or vLLM's ``p2p``), watched.

    Args:
        name: For request ids and messages.
        kind: ``ours`` or ``stock`` (vLLM's own P2P tier).
        num_chunks: The CPU tier's chunks.
        options: More of the tier's entry (``seed_peers``, ``event_log``, ...).
    """

    def __init__(
        self, name: str, *, kind: str = "ours", num_chunks: int = 64, **options: Any
    ) -> None:
        self.name = name
        self.kind = kind
        self.port = free_port()
        self.violations: list[str] = []
        self.reported: Counter[int] = Counter()
        options = {"tier_poll_interval_s": 0.001} | options
        poll = options.pop("tier_poll_interval_s")
        self.stack = build_stack(
            StackOptions(
                tiers=[tier_entry(kind, HOST, self.port, **options)],
                num_chunks=num_chunks,
                chunk_bytes=CHUNK_BYTES,
                engine_id=f"p2pactor-test-{name}-{os.getpid()}-{self.port}",
                tier_poll_interval_s=poll,
            )
        )
        self.engine = StackEngine(self.stack, name)
        self.tier = self.stack.tier
        self._watch()
        self._ids = 0

    @property
    def peer_id(self) -> str:
        """Its tier's ``host:port``."""
        return f"{HOST}:{self.port}"

    def violation(self, what: str) -> None:
        """Record a contract violation (checked at the end; raised where vLLM would swallow)."""
        self.violations.append(what)

    def _watch(self) -> None:
        manager, tier = self.stack.manager, self.tier
        with self.stack.lock:
            parent = _CheckedParent(self, manager._tier_parents[tier])
            manager._tier_parents[tier] = parent
        self.parent = parent
        serve, finished, poll = (
            tier.serve_external_requests,
            tier.get_finished_jobs,
            manager.poll_tiers,
        )

        def serve_external_requests(handle: Any) -> None:
            parent.lent += 1
            try:
                serve(handle)
            finally:
                parent.lent -= 1

        def get_finished_jobs() -> Any:
            results = list(finished())
            for result in results:
                self.reported[result.job_id] += 1
                if self.reported[result.job_id] > 1:
                    self.violation(f"job {result.job_id} reported twice")
            return results

        def poll_tiers() -> None:
            try:
                poll()
            except Exception as exc:
                self.violation(f"a tier-poll round raised {exc!r}")
                raise

        tier.serve_external_requests = serve_external_requests
        tier.get_finished_jobs = get_finished_jobs
        manager.poll_tiers = poll_tiers

    # --- requests ---------------------------------------------------------------

    def new_id(self, what: str = "req") -> str:
        """A request id unique on this node."""
        self._ids += 1
        return f"{self.name}-{what}-{self._ids}"

    def named(self, peer: StackNode, kv_request_id: str, role: str = "remote_kv_source") -> Any:
        """``kv_transfer_params`` naming ``peer`` in a consumer ``role``."""
        params = {"kv_request_id": kv_request_id, "remote_host": HOST, "remote_port": peer.port}
        return {role: params}

    def computed(self, keys: Sequence[bytes], params: dict[str, Any] | None = None) -> None:
        """A request computes ``keys`` with no lookup, then vLLM cascades them to the tier."""
        self.engine.compute(self.new_id("compute"), keys, params)
        run_until([self], self.quiet, f"{self.name}'s stores cascaded")

    def quiet(self) -> bool:
        """No request, and vLLM's manager has no job or cascade of its own outstanding.

        vLLM's ``has_pending_work()`` less its tiers' (the stock tier's is always True).
        """
        if self.engine.busy:
            return False
        with self.stack.lock:
            manager = self.stack.manager
            cascading = any(s.pending_cascade_keys for s in manager._req_state.values())
            return not manager._jobs and not cascading

    def holds(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, its CPU tier holds."""
        return self.engine.prefix(keys)

    def producer_events(self, kind: str, kv_request_id: str) -> list[Any]:
        """Our tier's events of ``kind`` for ``kv_request_id`` (its own name on the wire)."""
        return [
            e
            for e in self.tier.node.event_log.recent()
            if kind == e.KIND and e.actor.kv_request_id == kv_request_id
        ]

    # --- the end -----------------------------------------------------------------

    def settled(self) -> bool:
        """Nothing in flight: no request, no job, no open synthetic request, no pin."""
        if not self.quiet():
            return False
        with self.stack.lock:
            if self.kind == "ours" and self.tier.node.has_pending_work():
                return False
            return not self.parent.open_requests() and not self.pinned()

    def pinned(self) -> list[bytes]:
        """CPU-tier chunks held by someone (a load, a store, a tier's pin) or half-written."""
        chunks = self.stack.primary._policy.chunks
        return [k for k, chunk in chunks.items() if chunk.ref_cnt != 0]

    def check(self) -> None:
        """The end state: settled, and nothing vLLM's contract forbids ever happened."""
        assert self.violations == [], f"{self.name}: {self.violations}"
        with self.stack.lock:
            assert not self.stack.manager._jobs, f"{self.name}: jobs never reported"
            assert self.parent.open_requests() == set(), f"{self.name}: synthetic requests open"
            assert all(n == 1 for n in self.parent.finished.values()), self.parent.finished
            assert self.pinned() == [], f"{self.name}: chunks still pinned"

    def shutdown(self) -> None:
        """vLLM's ``manager.shutdown()``: the poll thread, the tier, the shared region."""
        self.stack.shutdown()


def run_until(
    nodes: Sequence[StackNode], cond: Callable[[], bool], what: str, timeout: float = TIMEOUT
) -> int:
    """Step every node that would step (vLLM's engine core) until ``cond``; the steps taken."""
    deadline = time.monotonic() + timeout
    steps = 0
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        stepped = False
        for node in nodes:
            if node.engine.wants_step():
                node.engine.step()
                stepped = True
        steps += stepped
        time.sleep(0.001 if stepped else 0.005)
    return steps


def settle(nodes: Sequence[StackNode], timeout: float = TIMEOUT) -> None:
    """Step until every node is settled, then check each."""
    run_until(nodes, lambda: all(n.settled() for n in nodes), "every node settled", timeout)
    for node in nodes:
        node.check()


@contextmanager
def open_nodes(*specs: tuple[str, dict[str, Any]]) -> Iterator[list[StackNode]]:
    """Nodes ``(name, options)``, shut down at the end (their regions gone from /dev/shm).

    A region vLLM's ``shutdown()`` left (it keeps it when a tier's shutdown
    failed, as a failed test can make it) is removed anyway, so no test leaves
    one behind; after a test that passed, one left is a failure.
    """
    left: list[str] = []

    def shut(node: StackNode) -> None:
        path = f"/dev/shm/vllm_offload_{node.stack.options.engine_id}.mmap"
        try:
            node.shutdown()
        finally:
            if os.path.exists(path):
                left.append(node.name)
                os.unlink(path)  # mappings stay valid: only the name goes

    with ExitStack() as stack:
        nodes = []
        for name, options in specs:
            node = StackNode(name, **options)
            stack.callback(shut, node)
            nodes.append(node)
        yield nodes
    assert left == [], f"offload regions left in /dev/shm: {left}"


def node_threads() -> set[threading.Thread]:
    """p2pactor's node threads alive in this process."""
    return {t for t in threading.enumerate() if t.name == "p2pactor-node"}
