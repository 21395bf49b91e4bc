"""Walk one request through the pure core: a consumer and a producer, back to back.

No sockets, no threads, no clock: messages are handed from one actor to the other
through the wire codec, the producer's parent cache is a dict, transfers copy
between two bytearrays, and time is a number we advance by hand. Every event is
printed as it happens, and at the end both logs are replayed to show that replay
rebuilds exactly the live state.

Run it with ``python examples/core_walkthrough.py``.
"""

from __future__ import annotations

from collections import deque

from p2pactor.core import (
    ActorId,
    ConsumerState,
    ProducerState,
    Role,
    fold,
    probe_answer,
    step_consumer,
    step_producer,
)
from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire

BLOCK = 16
CONSUMER_ID = "10.0.0.1:5710"
PRODUCER_ID = "10.0.0.2:5710"
KV_ID = "chat-42"


def block_key(i: int) -> bytes:
    """A 32-byte block hash followed by a 4-byte KV-cache group index."""
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def main() -> None:
    """Run the walkthrough and print the timeline."""
    keys = tuple(block_key(i) for i in range(4))
    # The producer holds blocks 0..2 of the prefix; block 3 is still being written.
    producer_pool = bytearray(BLOCK * 8)
    cache = {keys[0]: 5, keys[1]: 6, keys[2]: 7}
    for block in cache.values():
        producer_pool[block * BLOCK : (block + 1) * BLOCK] = bytes([block]) * BLOCK
    consumer_pool = bytearray(BLOCK * 8)

    consumer = ConsumerState.new(ActorId(Role.CONSUMER, PRODUCER_ID, KV_ID))
    producer = ProducerState.new(ActorId(Role.PRODUCER, CONSUMER_ID, KV_ID))
    consumer_log: list[ev.AnyEvent] = []
    producer_log: list[ev.AnyEvent] = []
    to_producer: deque[bytes] = deque()
    to_consumer: deque[bytes] = deque()
    now = 0.0

    def show(side: str, events: tuple[ev.AnyEvent, ...]) -> None:
        for e in events:
            print(f"{e.at:7.3f}s  {side:8s} #{e.seq:<2d} {e.KIND}")

    def run_consumer(event_input: object) -> None:
        nonlocal consumer
        consumer, events = step_consumer(consumer, event_input, now)  # type: ignore[arg-type]
        consumer_log.extend(events)
        show("consumer", events)
        for e in events:
            for effect in fx.effects_of(e):
                if isinstance(effect, fx.Send):
                    to_producer.append(wire.encode(effect.message))
                elif isinstance(effect, fx.ReportLoad):
                    print(f"           engine   load {effect.job_id} ok={effect.success}")

    def run_producer(event_input: object) -> None:
        nonlocal producer
        producer, events = step_producer(producer, event_input, now)  # type: ignore[arg-type]
        producer_log.extend(events)
        show("producer", events)
        for e in events:
            for effect in fx.effects_of(e):
                perform_producer_effect(effect)

    def perform_producer_effect(effect: fx.Effect) -> None:
        match effect:
            case fx.Send(message):
                to_consumer.append(wire.encode(message))
            case fx.ParentLookup():
                # The embedded parent: look up, then pin every hit as one job.
                results = tuple(
                    (k, inp.LookupResult.HIT if k in cache else inp.LookupResult.HIT_PENDING)
                    for k in effect.keys
                )
                hits = tuple(k for k, r in results if r is inp.LookupResult.HIT)
                pin = inp.Pin(1000 + effect.lookup_id, hits, tuple(cache[k] for k in hits))
                run_producer(inp.ParentAnswer(lookup_id=effect.lookup_id, results=results, pin=pin))
            case fx.StartTransfer():
                for src, dst in zip(effect.local_blocks, effect.remote_blocks, strict=True):
                    consumer_pool[dst * BLOCK : (dst + 1) * BLOCK] = producer_pool[
                        src * BLOCK : (src + 1) * BLOCK
                    ]
                run_producer(inp.TransferResult(transfer_id=effect.transfer_id, ok=True))
            case fx.ReleasePin():
                print(f"           parent   unpin job {effect.job_id}")
            case _:
                pass

    def deliver() -> None:
        while to_producer or to_consumer:
            while to_producer:
                run_producer(wire.decode(to_producer.popleft()))
            while to_consumer:
                run_consumer(wire.decode(to_consumer.popleft()))

    # Step 1: the engine asks about four keys; the step ends; the lookup goes out.
    run_consumer(inp.Register(keys))
    run_consumer(inp.Flush())
    deliver()
    # Step 2: 5 s pass; the producer's pending key expires and it answers.
    now = 5.0
    run_producer(inp.Tick())
    deliver()
    answers = [probe_answer(consumer, k).value for k in keys]
    print(f"           engine   answers {answers}")
    # Step 3: the engine loads the three hits into its blocks 0..2.
    hits = tuple(k for k in keys if probe_answer(consumer, k) is inp.LookupResult.HIT)
    run_consumer(inp.SubmitLoad(job_id=1, keys=hits, block_indexes=tuple(range(len(hits)))))
    deliver()
    run_consumer(inp.Finish())
    deliver()

    assert consumer_pool[: 3 * BLOCK] == producer_pool[5 * BLOCK : 8 * BLOCK]
    assert fold(consumer_log) == consumer
    assert fold(producer_log) == producer
    print("bytes equal; replaying both logs gives the live states")


if __name__ == "__main__":
    main()
