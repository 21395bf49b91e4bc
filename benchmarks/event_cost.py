"""What one event costs the pure core: per input (decide + evolve) and per event type.

Drives a consumer and a producer through the two lives a request has most
often, exactly as the runtime steps them (no I/O): a lookup that is answered
and then closed (the engine finished the request without a fetch), and a
lookup followed by a fetch of its hits. Each life is run with 1 and with 16
keys, ``--repeat`` times, with a parent that holds every key.

It prints two tables, medians in microseconds:

* per input: the whole step (``step_consumer`` / ``step_producer``: decide, and
  evolve once per event it emits), with the events the step emitted;
* per event type: making the event (its constructor, from its fields), folding
  it (``evolve``), deriving its effects (``effects_of``) and encoding it for
  the log (``encode_event``), each alone, and their sum.

Run it from the repository root: ``python benchmarks/event_cost.py``
(``--json PATH`` writes the figures too).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pactor.core import effects as fx
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.consumer import ConsumerState, step_consumer
from p2pactor.core.fold import evolve
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerState, step_producer
from p2pactor.core.serde import encode_event

PEER = "10.0.0.2:5710"
Step = tuple[str, str, float, tuple[Any, ...]]  # role, input, seconds, events


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def _fields(record: Any) -> dict[str, Any]:
    names = getattr(type(record), "__struct_fields__", None)
    if names is None:  # an attrs record
        names = [a.name for a in type(record).__attrs_attrs__]
    return {name: getattr(record, name) for name in names}


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _life(kv: str, nkeys: int, *, fetch: bool, first_job: int) -> list[Step]:
    """One request on both sides; the steps as the runtime would make them."""
    keys = tuple(_key(i) for i in range(nkeys))
    steps: list[Step] = []
    now = 1.0
    c = ConsumerState.new(ActorId(Role.CONSUMER, PEER, kv))
    p = ProducerState.new(ActorId(Role.PRODUCER, PEER, kv))

    def consume(item: Any) -> tuple[Any, ...]:
        nonlocal c
        (c, events), took = _timed(lambda: step_consumer(c, item, now))
        steps.append(("consumer", type(item).__name__, took, events))
        return events

    def produce(item: Any) -> tuple[Any, ...]:
        nonlocal p
        (p, events), took = _timed(lambda: step_producer(p, item, now))
        steps.append(("producer", type(item).__name__, took, events))
        return events

    def sent(events: tuple[Any, ...]) -> list[wire.Message]:
        return [e.message for x in events for e in fx.effects_of(x) if isinstance(e, fx.Send)]

    open_round = getattr(inp, "Open", None)
    if open_round is not None:
        consume(open_round(first_round=0))
    (lookup,) = sent(consume(inp.Register(keys, flush=True)))
    asked = [e for x in produce(lookup) for e in fx.effects_of(x)]
    ask = next(e for e in asked if isinstance(e, fx.ParentLookup))
    pin = inp.Pin(first_job, ask.keys, tuple(range(len(ask.keys))))
    results = tuple((k, inp.LookupResult.HIT) for k in ask.keys)
    answer = inp.ParentAnswer(lookup_id=ask.lookup_id, results=results, pin=pin)
    (resp,) = sent(produce(answer))
    consume(resp)
    if fetch:
        (fetch_msg,) = sent(
            consume(inp.SubmitLoad(job_id=first_job, keys=keys, block_indexes=tuple(range(nkeys))))
        )
        started = [e for x in produce(fetch_msg) for e in fx.effects_of(x)]
        write = next(e for e in started if isinstance(e, fx.StartTransfer))
        (done,) = sent(produce(inp.TransferResult(transfer_id=write.transfer_id, ok=True)))
        consume(done)
        consume(inp.Finish())
    else:
        (close,) = sent(consume(inp.Finish()))
        produce(close)
    return steps


def _per_event(events: list[Any], states: dict[int, Any]) -> dict[str, dict[str, float]]:
    """Time making, folding, effects and encoding of each event, alone."""
    costs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i, event in enumerate(events):
        kind = type(event).__name__
        fields = _fields(event)
        cls = type(event)
        before = states[i]
        _, made = _timed(lambda: cls(**fields))  # noqa: B023
        _, folded = _timed(lambda: evolve(before, event))  # noqa: B023
        _, effects = _timed(lambda: fx.effects_of(event))  # noqa: B023
        _, encoded = _timed(lambda: encode_event(event))  # noqa: B023
        row = costs[kind]
        row["make"].append(made)
        row["evolve"].append(folded)
        row["effects"].append(effects)
        row["encode"].append(encoded)
    out: dict[str, dict[str, float]] = {}
    for kind, row in costs.items():
        med = {part: statistics.median(values) * 1e6 for part, values in row.items()}
        med["total"] = sum(med.values())
        med["n"] = len(row["make"])
        out[kind] = med
    return out


def main() -> None:
    """Run the lives, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000, help="lives of each kind")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    gc.disable()  # collections would land in whichever step happens to run then
    steps: list[Step] = []
    for r in range(args.repeat):
        for nkeys in (1, 16):
            for fetch in (False, True):
                kv = f"r{r}-{nkeys}-{int(fetch)}"
                steps += _life(kv, nkeys, fetch=fetch, first_job=1000 + 4 * r)
        if r % 100 == 0:
            gc.collect()
    by_input: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for role, name, took, events in steps:
        kinds = "+".join(type(e).__name__ for e in events)
        by_input[role, name, kinds].append(took)
    # Per event: the state before each event, by replaying each actor.
    events: list[Any] = []
    states: dict[int, Any] = {}
    current: dict[ActorId, Any] = {}
    for _, _, _, emitted in steps[: 8 * 2 * 50 * 4]:
        for event in emitted:
            before = current.get(event.actor)
            if before is None:
                new = ConsumerState.new if event.actor.role is Role.CONSUMER else ProducerState.new
                before = new(event.actor)
            states[len(events)] = before
            events.append(event)
            current[event.actor] = evolve(before, event)
    per_event = _per_event(
        events * 20, {i + n * len(events): s for n in range(20) for i, s in states.items()}
    )
    say = sys.stdout.write
    say("per input (decide + evolve of its events), median us\n")
    say(f"{'role':9} {'input':15} {'us':>8} {'events':>6}  kinds\n")
    rows = []
    for (role, name, kinds), took in sorted(by_input.items()):
        med = statistics.median(took) * 1e6
        n_events = len(kinds.split("+")) if kinds else 0
        rows.append({"role": role, "input": name, "events": kinds, "us": med, "n": len(took)})
        say(f"{role:9} {name:15} {med:8.1f} {n_events:6}  {kinds}\n")
    say("\nper event type, median us: make + evolve + effects + encode (the log's bytes)\n")
    say(f"{'event':18} {'make':>6} {'evolve':>7} {'effects':>8} {'encode':>7} {'total':>7}\n")
    for kind, row in sorted(per_event.items(), key=lambda kv: -kv[1]["total"]):
        say(
            f"{kind:18} {row['make']:6.2f} {row['evolve']:7.2f} {row['effects']:8.2f} "
            f"{row['encode']:7.2f} {row['total']:7.2f}\n"
        )
    lives = defaultdict(float)
    for role, _, took, _ in steps:
        lives[role] += took
    n_lives = args.repeat * 4
    say(
        f"\nper life (mean over {n_lives} lives of 4 kinds): consumer "
        f"{lives['consumer'] / n_lives * 1e6:.1f} us, producer "
        f"{lives['producer'] / n_lives * 1e6:.1f} us\n"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"inputs": rows, "events": per_event}, indent=1))


if __name__ == "__main__":
    main()
