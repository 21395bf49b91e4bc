"""The ``scale`` section's measurements, each in a fresh interpreter (for its peak RSS).

``python -m p2pactor.programs.bench._scale_run WHAT ARGS...`` prints one line, ``RESULT
{...}`` (:data:`MEASURES`):

* ``requests N DIR``: two nodes in this process over the in-memory
  transports of :mod:`p2pactor.testing` (the network is not what is measured; the actors
  are), each writing a real :class:`~p2pactor.runtime.log.EventLog` on disk. Node ``a``
  starts N requests at once against ``b`` (which holds every key in an embedded cache);
  each looks up :data:`KEYS_PER_REQUEST` keys, fetches the hits and finishes: seconds
  until all were done, events appended to both logs, requests failed, peak RSS, growth.
* ``write M L A B``: a log of M events, the events of the logs
  ``A`` and ``B`` (a real run's actors) repeated under fresh request ids.
* ``replay MODE LOG``: read (``read``) or replay (``replay``, ``replay --check``) ``LOG``:
  seconds, events, peak RSS growth.
* ``costs N`` (what the old ``event_cost.py`` measured), in-process: the **event cost**
  of the pure core, no I/O, a consumer and a producer stepped as the
  runtime steps them through N lives of each kind (a lookup answered then closed, a
  lookup then a fetch of its hits; 1 and 16 keys): the median of each input's step and
  the mean per life and role.
"""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import trio

from p2pactor.programs.bench._control_common import peak_rss_kib, say

KEYS_PER_REQUEST = 4
"""Keys per request: the producer holds all but the last (3 hits, 1 miss)."""
BLOCK_LEN = 256
"""Bytes per block: small, the copy is not what is measured."""


async def _requests(n: int, folder: str) -> dict[str, Any]:
    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.log import Durability, EventLog  # noqa: PLC0415
    from p2pactor.runtime.node import open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.runtime.quotas import PeerQuotas  # noqa: PLC0415
    from p2pactor.testing import MemoryDataPlane, MemoryNetwork  # noqa: PLC0415

    held, room = 4096, 10 * n + 1000
    keys = [f"scale-key-{i}".encode().ljust(36, b".") for i in range(held + 1)]
    missing = keys[held]  # never stored: every request's last key misses
    caches = {"a": EmbeddedCache(n * (KEYS_PER_REQUEST - 1) + 16, BLOCK_LEN)}
    caches["b"] = EmbeddedCache(held, BLOCK_LEN)
    for i, key in enumerate(keys[:held]):
        caches["b"].store(key, bytes([i % 256]) * BLOCK_LEN)
    # Nothing may be refused: the point is N requests at once from one peer.
    quotas = PeerQuotas(
        max_pinned_blocks=10**9,
        max_open_lookups=10**7,
        max_fetch_rounds=10**7,
        max_open_requests=10**7,
    )
    network, plane = MemoryNetwork(capacity=room), MemoryDataPlane()
    logs = [
        EventLog(
            f"{x}:5710",
            path=f"{folder}/{x}.log",
            durability=Durability.interval(),
            keep=0,
            overwrite=True,
        )
        for x in "ab"
    ]

    def node(name: str, log: Any) -> Any:
        cache = caches[name]
        config = NodeConfig(
            host=name,
            port=5710,
            num_blocks=cache.num_blocks,
            block_len=BLOCK_LEN,
            quotas=quotas,
            engine_inbox=room,
            session_outbox=room,
        )
        control, data = network.transport(f"{name}:5710"), plane.transport(cache.memory, BLOCK_LEN)
        return open_node(config, control=control, data=data, parent=cache, event_log=log)

    failed = 0
    rss0 = peak_rss_kib()
    async with node("b", logs[1]), node("a", logs[0]) as a:

        async def one(i: int) -> None:
            nonlocal failed
            kv, start, cache = f"scale-{i}", (i * 7) % (held - KEYS_PER_REQUEST), caches["a"]
            wanted = [*keys[start : start + KEYS_PER_REQUEST - 1], missing]
            answers = await a.lookup("b:5710", kv, wanted)
            hits = [k for k, x in zip(wanted, answers, strict=True) if x is LookupResult.HIT]
            blocks = cache.allocate(len(hits))
            if hits and (await a.fetch("b:5710", kv, hits, blocks)).success:
                for key, block in zip(hits, blocks, strict=True):
                    cache.commit(key, block)
            else:
                cache.free(blocks)
                failed += 1
            a.finish(kv)

        # The handshake first: the N requests measure the actors, not a pile-up
        # of frames queued behind a session that is not up yet.
        await a.lookup("b:5710", "scale-warmup", keys[:1])
        a.finish("scale-warmup")
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        seconds = time.perf_counter() - t0
        peak = peak_rss_kib()
    return {
        "requests": n,
        "seconds": seconds,
        "events": sum(log.statistics().events_appended for log in logs),
        "failed": failed,
        "peak_rss_kib": peak,
        "rss_growth_kib": peak - rss0,
    }


def _repeat(paths: Sequence[str], total: int) -> Iterator[Any]:
    """``total`` events: the logs' events, again and again under fresh request ids."""
    from msgspec.structs import replace  # noqa: PLC0415

    from p2pactor.runtime.logread import read_log  # noqa: PLC0415

    pattern = [e for path in paths for e in read_log(path)]
    for n in range(total if pattern else 0):
        e = pattern[n % len(pattern)]
        kv = f"{e.actor.kv_request_id}/{n // len(pattern)}"
        yield replace(e, actor=replace(e.actor, kv_request_id=kv))


def _write(paths: Sequence[str], total: int, out: str) -> dict[str, Any]:
    from p2pactor.runtime.log import Durability, EventLog  # noqa: PLC0415

    t0 = time.perf_counter()
    with EventLog(
        "replay:5710", path=out, durability=Durability.interval(), keep=0, overwrite=True
    ) as log:
        events = _repeat(paths, total)
        while batch := list(itertools.islice(events, 64)):
            log.append(batch)
        stats = log.statistics()
    return {
        "events": stats.events_appended,
        "bytes": stats.bytes_written,
        "seconds": time.perf_counter() - t0,
    }


def _replay(mode: str, path: str) -> dict[str, Any]:
    from p2pactor.runtime.logread import read_log  # noqa: PLC0415
    from p2pactor.surface.replay import replay_logs  # noqa: PLC0415

    before = peak_rss_kib()
    t0 = time.perf_counter()
    violations = 0
    if mode == "read":
        events = sum(1 for _ in read_log(path))
    else:
        run = replay_logs([path], check=mode.endswith("--check"), timelines=0)
        for _ in run:
            pass
        events = run.summary().events
        violations = len(run.violations)
    return {
        "mode": mode,
        "seconds": time.perf_counter() - t0,
        "events": events,
        "violations": violations,
        "growth_kib": peak_rss_kib() - before,
    }


PEER = "10.0.0.2:5710"


def _life(kv: str, nkeys: int, *, fetch: bool, job: int, out: list[Any]) -> None:
    """One request on both sides, each step timed: ``(role, input, seconds)`` to ``out``."""
    from p2pactor.core import effects as fx  # noqa: PLC0415
    from p2pactor.core import inputs as inp  # noqa: PLC0415
    from p2pactor.core.consumer import ConsumerState, step_consumer  # noqa: PLC0415
    from p2pactor.core.ids import ActorId, Role  # noqa: PLC0415
    from p2pactor.core.producer import ProducerState, step_producer  # noqa: PLC0415

    keys = tuple(i.to_bytes(32, "big") + bytes(4) for i in range(nkeys))
    state = {
        "consumer": ConsumerState.new(ActorId(Role.CONSUMER, PEER, kv)),
        "producer": ProducerState.new(ActorId(Role.PRODUCER, PEER, kv)),
    }
    steppers: dict[str, Any] = {"consumer": step_consumer, "producer": step_producer}

    def step(role: str, item: Any) -> list[Any]:
        t0 = time.perf_counter()
        state[role], events = steppers[role](state[role], item, 1.0)
        out.append((role, type(item).__name__, time.perf_counter() - t0))
        return [e for x in events for e in fx.effects_of(x)]

    def sent(effects: list[Any]) -> list[Any]:
        return [e.message for e in effects if isinstance(e, fx.Send)]

    (lookup,) = sent(step("consumer", inp.Register(keys, flush=True)))
    ask = next(e for e in step("producer", lookup) if isinstance(e, fx.ParentLookup))
    pin = inp.Pin(job, ask.keys, tuple(range(len(ask.keys))))
    hits = tuple((k, inp.LookupResult.HIT) for k in ask.keys)
    (resp,) = sent(
        step("producer", inp.ParentAnswer(lookup_id=ask.lookup_id, results=hits, pin=pin))
    )
    step("consumer", resp)
    if fetch:
        load = inp.SubmitLoad(job_id=job, keys=keys, block_indexes=tuple(range(nkeys)))
        (fetch_msg,) = sent(step("consumer", load))
        write = next(e for e in step("producer", fetch_msg) if isinstance(e, fx.StartTransfer))
        (done,) = sent(step("producer", inp.TransferResult(transfer_id=write.transfer_id, ok=True)))
        step("consumer", done)
        step("consumer", inp.Finish())
    else:
        (close,) = sent(step("consumer", inp.Finish()))
        step("producer", close)


def event_cost(lives: int) -> dict[str, Any]:
    """Median us per (role, input), and mean us per life and role."""
    steps: list[Any] = []
    gc.disable()  # a collection would land in whichever step runs then
    for r in range(lives):
        for nkeys in (1, 16):
            for fetch in (False, True):
                _life(f"r{r}-{nkeys}-{fetch:d}", nkeys, fetch=fetch, job=1000 + r, out=steps)
        if r % 100 == 0:
            gc.collect()
    gc.enable()
    by_input: dict[str, list[float]] = defaultdict(list)
    per_role: dict[str, float] = defaultdict(float)
    for role, name, took in steps:
        by_input[f"{role} {name}"].append(took)
        per_role[role] += took
    return {
        "inputs": {k: statistics.median(v) * 1e6 for k, v in sorted(by_input.items())},
        "lives": {k: v / (4 * lives) * 1e6 for k, v in per_role.items()},
    }


MEASURES: dict[str, Callable[..., dict[str, Any]]] = {
    "requests": lambda n, folder: trio.run(_requests, int(n), folder),
    "write": lambda total, out, *logs: _write(logs, int(total), out),
    "replay": _replay,
    "costs": lambda lives: event_cost(int(lives)),
}
"""Each measurement by its name, from its arguments (strings, as given)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one measurement; print it as one ``RESULT {...}`` line."""
    what, *args = sys.argv[1:] if argv is None else argv
    say(f"RESULT {json.dumps(MEASURES[what](*args))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
