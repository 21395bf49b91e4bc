"""p2pactor as a secondary tier of vLLM's tiered KV offloading (vLLM 0.33).

Load it out of tree by naming it in the engine's KV transfer config::

    "secondary_tiers": [{"type": "P2PActorTierManager",
                         "module_path": "p2pactor.adapters.vllm",
                         "host": "10.0.0.1", "port": 5710}]

Across hosts add ``"bind_host": "0.0.0.0"`` to listen on every interface while
peers dial ``host`` (``docs/deploy.md``).

It speaks vLLM's P2P wire dialect, so engines running it and engines running
vLLM's own ``p2p`` tier share blocks with each other.

How it meets vLLM's threading contract: vLLM calls every method synchronously,
under its lock, from the scheduler thread or its tier-poll thread. A p2pactor
node runs on its own trio thread (sockets, timers, decoding, NIXL completions
all live there); the methods here only hand work over without waiting
(``Node.register_lookup``, ``flush``, ``submit_load``, ...) and read what the
trio thread has already published (``get_stats`` too: the node's metrics reach
vLLM's ``/metrics`` as ``vllm:kv_offload_p2pactor_*``). The parent handle vLLM lends to
``serve_external_requests`` is used only inside that call, through
:class:`~p2pactor.adapters._vllm_parent.LentParent`, and never kept.

A request that names no source is given one by the tier, from what its
peers' summaries claim (``_vllm_auto.py``, ``docs/sources.md``); what this
engine's CPU tier holds is told to them in turn, ranked as vLLM's LRU ranks it
(stores and our loads by request and position, each request's end, touches, a
check through the lent parent sized to the tier's churn, a new epoch at
``drain_jobs``).

Its parts: ``_vllm_api.py`` (vLLM 0.33's API, and the options as a ``NodeConfig``),
``_vllm_parent.py`` (the jobs owed to vLLM, and the lent parent; through it, the
check and the watch of what vLLM is writing), ``_vllm_auto.py`` (the automatic
choice), ``_vllm_thread.py`` (the node's thread, and its figures in ``/metrics``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from p2pactor.adapters import _vllm_api as api
from p2pactor.adapters._vllm_auto import Auto, AutoSources
from p2pactor.adapters._vllm_parent import JobBook, LentParent, Watch, scrub
from p2pactor.adapters._vllm_thread import NodeThread, metric_definitions
from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.runtime.engine import LookupView
from p2pactor.runtime.logcontext import request_context
from p2pactor.runtime.node import Node

__all__ = ["P2PActorTierManager"]

log = logging.getLogger("p2pactor.vllm")

_DRAIN_TIMEOUT_S = 30.0


class _Seen:
    """A request's first lookup here was seen (its ``ReqContext`` state)."""


class P2PActorTierManager(api.SecondaryTierManager):  # type: ignore[misc]  # vLLM is Any to mypy
    """A vLLM secondary tier backed by a p2pactor node.

    vLLM's factory passes ``offloading_spec`` (the model and cache layout give
    the fingerprint; the data-parallel index offsets the port),
    ``primary_kv_view`` (the CPU primary tier's memory, one row per chunk: the
    NIXL block pool) and ``tier_type``; ``backpressure_detector`` must be None,
    as for vLLM's P2P tier. The keyword options are the ``secondary_tiers``
    entry's: ``host``, ``bind_host``, ``port``, ``unbound_store_timeout_s``,
    ``allowed_peers``, ``seed_peers``, ``summaries``, ``event_log``,
    ``slow_step_ms``, ``curve_secret_key``, ``curve_trusted``, each with its
    environment variable and default in ``docs/vllm.md``'s options table; the
    keys vLLM's own P2P tier takes (``backends``, ``num_threads``,
    ``locality``) are accepted and ignored, anything else is an error.
    """

    cache_hit_source: ClassVar[Any] = api.CacheHitSource.P2P
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "p2pactor",
        *,
        backpressure_detector: Any = None,
        event_log: str | None = None,
        **options: Any,
    ) -> None:
        api.require_tier_polling()
        if backpressure_detector is not None:  # vLLM's p2p tier's words, then ours
            raise ValueError(
                "Backpressure is not supported for the P2P secondary tier. The generic "
                "store-latency detector cannot fail fast in PD mode and rendezvous time makes "
                "store latency an unreliable pressure signal. Remove the 'backpressure' config "
                "from the p2p tier. (p2pactor's tier refuses it for the same reasons: remove "
                "'backpressure' from its secondary_tiers entry, and from "
                "kv_connector_extra_config, which vLLM hands to every tier.)"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        config = api.tier_config(offloading_spec, primary_kv_view, self.block_size_bytes, options)
        self._contexts: dict[str, api.ReqContext] = {}
        self._asks: dict[tuple[str, str], dict[bytes, None]] = {}
        self._views: dict[tuple[str, str], LookupView] = {}  # this step's, per request
        self._runner = NodeThread(config, primary_kv_view, event_log)
        self._node: Node = self._runner.start()
        self.jobs = JobBook(self._node, config.block_len)
        self._auto = AutoSources(self._node, config.sources.choice.tail_keys)
        self._watch = Watch(self._node)
        # vLLM's scheduler thread (it builds the tier and steps it); its
        # tier-poll thread is another.
        self._scheduler = threading.get_ident()
        # With vLLM's tier-poll thread off, tiers are served only at engine steps,
        # and an idle engine takes none unless a tier asks: ask, as vLLM's p2p tier
        # always does.
        poll_s = getattr(offloading_spec, "tier_poll_interval_s", 1.0)
        self._always_stepping = poll_s <= 0
        if self._always_stepping:
            log.warning(
                "vLLM's tier-poll thread is off (tier_poll_interval_s=%g): the p2pactor tier "
                "keeps the engine stepping, idle or not, to serve its peers, as vLLM's p2p "
                "tier does; set tier_poll_interval_s to 0.001 (vLLM's default) to serve them "
                "from that thread and let an idle engine rest",
                poll_s,
            )
        log.info(
            "p2pactor tier %s ready (%d blocks of %d bytes)",
            config.node_id,
            config.num_blocks,
            config.block_len,
        )

    # --- per request -------------------------------------------------------------

    def on_new_request(self, req_context: api.ReqContext) -> api.RequestOffloadingContext:
        """Read the request's role from its kv_transfer_params, once."""
        params = req_context.kv_transfer_params
        source = api.parse_source(params)
        config = self._node.config
        if source is not None and not config.may_dial(source.peer):
            log.warning(
                "request %s names %s, %s; not dialing it",
                req_context.req_id,
                source.peer,
                config.dial_refusal(source.peer)
                or "which is not in allowed_peers or has no trusted CURVE key (add it to "
                "allowed_peers, or its .key to curve_trusted)",
                extra=request_context(source.peer, source.kv_request_id, node=config.node_id),
            )
            source = None
        if source is not None:
            req_context.set_state(source)
            self._node.prepare(source.peer, wake=False)  # handshake before its lookups
        dest = api.parse_dest(params)
        if dest is not None:
            req_context.set_state(dest)
            if dest.kv_request_id is not None:
                return api.RequestOffloadingContext(policy=api.OffloadPolicy.REQUEST_LEVEL)
        elif source is None:
            self._auto.begin(req_context)  # no source named: the summaries may know one
        return api.RequestOffloadingContext()

    def lookup(self, key: Any, req_context: api.ReqContext) -> Any:
        """HIT, MISS or RETRY (while the peer is being asked) for one key."""
        if req_context.get_state(_Seen) is None:
            self._reused_before(key, req_context)
        source = req_context.get_state(api.Source)
        if source is None:
            auto = req_context.get_state(Auto)
            if auto is None:
                return api.VLLM_MISS
            source = self._auto.lookup(auto, key, req_context)
            if isinstance(source, Answer):
                return api.TO_VLLM[source]
        if source.kv_request_id in self.jobs.failed:
            return api.VLLM_MISS
        if not source.probe:
            return api.VLLM_HIT  # prefill/decode: the prefiller holds everything
        k = bytes(key)
        if source.only is not None and k not in source.only:
            return api.VLLM_MISS  # chosen by us for its claimed keys: nobody claimed this one
        where = (source.peer, source.kv_request_id)
        view = self._views.get(where)
        if view is None:  # one snapshot per scan: see lookup_view
            view = self._views[where] = self._node.lookup_view(*where)
        answer = view.answer(k)
        if answer is Answer.RETRY:
            # Asked at the step's end, all keys of the request in one go: vLLM
            # calls this once per key per step while the answer is out.
            self._asks.setdefault(where, {})[k] = None
        return api.TO_VLLM[answer]

    def _reused_before(self, key: Any, ctx: api.ReqContext) -> None:
        """The request's first lookup here: the keys before ``key`` are the CPU tier's hits.

        vLLM asks a tier only past them, and loads them from the CPU tier now:
        its LRU ranks them as the request's (``holdings.py``), and so does our
        summary.
        """
        ctx.set_state(_Seen())
        record = api.request_keys(ctx) or {}
        if (where := record.get(bytes(key))) is None:
            return
        held = [k for k, p in record.items() if p < where]
        if held:
            self._node.reused(held, ctx.req_id, [record[k] for k in held])
        if ctx.get_state(api.Dest) is None:  # a remote decoder's blocks are not ours to claim
            self._watch.follow(ctx.req_id, record, where)

    def on_request_finished(self, req_context: api.ReqContext) -> None:
        """The engine is done with the request (either role)."""
        source = req_context.get_state(api.Source)
        dest = req_context.get_state(api.Dest)
        auto = req_context.get_state(Auto)
        if auto is not None and source is None:
            self._auto.finished(auto)
        self._watch.finished(req_context.req_id)
        record = api.request_keys(req_context)
        if record:  # what it reused of the CPU tier, if not seen at its lookups
            self._node.reused(list(record), req_context.req_id, list(record.values()))
        self._node.ended(req_context.req_id)  # vLLM's LRU ranks its chunks afresh now
        for kv_id in dict.fromkeys(r.kv_request_id for r in (source, dest) if r is not None):
            if kv_id is not None:  # a load's failure is forgotten with it
                self.jobs.failed.discard(kv_id)
                self._node.finish(kv_id, wake=False)

    def submit_store(self, job_metadata: Any) -> None:
        """Keep a prefill/decode request's blocks for its remote puller."""
        ctx = job_metadata.req_context
        dest = ctx.get_state(api.Dest)
        job_id = int(job_metadata.job_id)
        keys = [bytes(k) for k in job_metadata.keys]
        if dest is None:
            # Symmetric P2P: blocks stay in the CPU primary tier; nothing moves.
            # They are ours to claim: peers hear of them in the next delta.
            self.jobs.at_once(job_id, success=True)
            self._node.holds(keys, request=ctx.req_id, positions=api.positions(ctx, keys))
        elif dest.kv_request_id is None:
            self.jobs.at_once(job_id, success=False)
        else:
            self.jobs.track_store(job_id, dest.kv_request_id, len(keys))
            # Woken at once: a store may come with no step to follow it.
            self._node.submit_store(dest.kv_request_id, job_id, keys, api.job_ids(job_metadata))

    def submit_load(self, job_metadata: Any) -> None:
        """Pull keys from the request's source peer into the given chunks."""
        ctx = job_metadata.req_context
        source = ctx.get_state(api.Source)
        job_id = int(job_metadata.job_id)
        keys = [bytes(k) for k in job_metadata.keys]
        if source is None or not keys:
            self.jobs.at_once(job_id, success=source is not None)
        else:
            kv_id = source.kv_request_id
            self.jobs.load(job_id, kv_id, keys, ctx, api.positions(ctx, keys))
            self._node.reserve(len(keys))  # vLLM evicted for these chunks: claim less
            self._node.submit_load(
                source.peer, kv_id, job_id, keys, api.job_ids(job_metadata), wake=False
            )

    # --- per step ----------------------------------------------------------------

    def get_finished_jobs(self) -> Iterable[api.JobResult]:
        """Loads and stores that finished since the last call, each exactly once."""
        return self.jobs.take()

    def serve_external_requests(self, parent: api.ParentManager) -> None:
        """Let peers' lookups, pins and releases run against the lent parent.

        And check the keys our summary would lose next against the CPU tier
        (a tier never hears of evictions): a batch whenever the node has one
        due, sized to what the tier stored since (``SummaryOptions.scrub_per_key``).
        """
        node = self._node
        node.serve_parent(LentParent(self._contexts, self.jobs, parent))
        if threading.get_ident() == self._scheduler:
            # The step's serve (in on_schedule_end): vLLM has just evicted for the
            # step's stores. Ask about the keys it evicts next, so a claim it
            # dropped leaves the peers before the forward pass is over.
            if gone := scrub(parent, node.take_frontier(), node.node_id)[0]:
                node.scrubbed(gone, ())
            # And it has just prepared the step's stores: claim them now.
            self._watch.check(parent, self.jobs.loading())
        if batch := node.take_scrub():
            node.scrubbed(*scrub(parent, batch, node.node_id))

    def touch(self, keys: Collection[Any], req_context: api.ReqContext) -> None:
        """The engine reused ``keys``: the most recent in our summary's order now."""
        del req_context
        self._node.touch([bytes(k) for k in keys])

    def on_schedule_end(self, context: Any) -> None:
        """The step ended: hand its new lookups and calls to the node, wake it once."""
        del context
        self._auto.step_ended()
        self._views.clear()
        asks, self._asks = self._asks, {}
        for (peer, kv_id), keys in asks.items():
            self._node.ask(peer, kv_id, list(keys))
        self._node.flush()

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping for this tier (always, with no poll thread)."""
        return self._always_stepping or self._node.has_pending_work()

    def drain_jobs(self) -> None:
        """Wait (bounded) until every load submitted has finished and no write runs.

        Loads are tracked here from the moment vLLM submits them, not from when
        the node's thread picks them up: a load still queued for the node must
        hold the drain too, or it would write into chunks vLLM reuses.
        """
        self._node.kick()
        self._node.drained()  # vLLM resets its cache after this: a new epoch for the peers
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while True:
            self.jobs.collect()
            if not self.jobs.loads and not self._node.has_transfers_in_flight():
                return
            if time.monotonic() > deadline:
                log.warning(
                    "drain_jobs gave up after %.0f s: %d loads still in flight (their peers "
                    "stopped answering; see the session lines above)",
                    _DRAIN_TIMEOUT_S,
                    len(self.jobs.loads),
                )
                return
            time.sleep(0.001)

    def shutdown(self) -> None:
        """Close the node: sessions drain for up to 3 s, as vLLM's tier does."""
        self._runner.stop(timeout=api.SHUTDOWN_DRAIN_S + 10)
        self.jobs.forget()  # no result can come from a stopped node

    # --- vLLM's /metrics -----------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The ``vllm:kv_offload_p2pactor_*`` metrics this tier reports (docs/vllm.md)."""
        del extra_config  # always on: the figures cost the engine's thread nothing
        return metric_definitions()

    def get_stats(self) -> Any:
        """What the node counted since the last call: counter increases, gauges now.

        Never waits: it reads the totals the node's thread last published (at
        most 0.1 s old), and returns None while they have not changed.
        """
        return self._runner.stats()

    # --- introspection -------------------------------------------------------------

    @property
    def node(self) -> Node:
        """The p2pactor node behind the tier."""
        return self._node

    def __repr__(self) -> str:
        return f"<P2PActorTierManager {self._node.node_id}>"
