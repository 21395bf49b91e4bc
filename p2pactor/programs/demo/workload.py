"""The demo's workload: prompts, their block keys and contents, who holds what.

Everything is a pure function of a :class:`DemoPlan`, so every process of the
demo computes the same keys, contents and expectations without talking.

* Keys chain like vLLM's: each block's hash covers the previous block's hash,
  its tokens and the shared hash seed; the key is that hash followed by a
  4-byte KV-cache group index (0).
* A few *system prompts* are shared prefixes of many requests, so prefixes
  overlap across nodes.
* Each request of a consumer is a follow-up of a conversation some producer
  already served: the producer holds the conversation's blocks (system prefix
  and suffix); the follow-up adds new blocks nobody holds (misses). Other
  nodes hold the system prefix too, so the producer is the peer with the
  longest run: the one a request naming no source should find. Some
  conversations are still being written on the producer when the lookup
  arrives (HIT_PENDING): most finish shortly (they resolve to HIT), a few never
  do (they expire to MISS after the producer's 5 s deadline).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator

import attrs

from p2pactor.errors import ConfigError
from p2pactor.runtime.samples import chain_keys

__all__ = ["DemoPlan", "Expect", "Request", "requests_of"]


class Expect(enum.Enum):
    """What a lookup of one key should answer in the demo."""

    HIT = "hit"
    """Stored on the producer."""
    PENDING = "pending"
    """Being written on the producer; stored before the deadline: a HIT, late."""
    EXPIRE = "expire"
    """Being written and never finished: a MISS at the producer's deadline."""
    MISS = "miss"
    """Never seen by the producer."""


def _at_least(minimum: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if type(value) is not int or value < minimum:
            raise ConfigError(f"{attribute.name} must be an integer >= {minimum}, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class DemoPlan:
    """The shape of a demo run.

    Attributes:
        nodes: Node processes.
        requests: Requests each node makes as a consumer.
        system_prompts: Shared prefixes that many conversations start with.
        prefix_blocks: Blocks in a system prompt.
        suffix_blocks: Blocks a producer's conversation adds to its prefix.
        new_blocks: Blocks a follow-up request adds (nobody holds them).
        block_len: Bytes per block.
        seed: Seeds the hash chain and the contents.
        pending_every: Every n-th conversation is still being written on its
            producer when the lookup arrives (0: none).
        expire_every: Every n-th conversation never finishes writing (0: none).
        pending_delay: Seconds until a pending conversation is stored.
        concurrency: Requests a node keeps in flight at once.
        handshake_timeout: Seconds a node gives a session's handshake (the
            node default, 30 s, unless many nodes share very few cores).
        named: Each request names its source (the node that served the
            conversation), as a router would. By default a request names
            none: the node finds it in its peers' summaries
            (``docs/sources.md``).
    """

    nodes: int = attrs.field(default=3, validator=_at_least(2))
    requests: int = attrs.field(default=12, validator=_at_least(1))
    system_prompts: int = attrs.field(default=3, validator=_at_least(1))
    prefix_blocks: int = attrs.field(default=8, validator=_at_least(1))
    suffix_blocks: int = attrs.field(default=4, validator=_at_least(1))
    new_blocks: int = attrs.field(default=2, validator=_at_least(0))
    block_len: int = attrs.field(default=64 * 1024, validator=_at_least(1))
    seed: int = 0
    pending_every: int = attrs.field(default=4, validator=_at_least(0))
    expire_every: int = attrs.field(default=7, validator=_at_least(0))
    pending_delay: float = 0.3
    concurrency: int = attrs.field(default=4, validator=_at_least(1))
    handshake_timeout: float = 30.0
    named: bool = False

    @property
    def hash_seed(self) -> str:
        """The hash seed every node advertises (they must agree)."""
        return f"p2pactor-demo-{self.seed}"

    @property
    def request_blocks(self) -> int:
        """Blocks in one request: prefix, suffix and new blocks."""
        return self.prefix_blocks + self.suffix_blocks + self.new_blocks

    def pool_blocks(self) -> int:
        """Blocks each node's pool needs: what it holds for others and what it fetches."""
        held = self.requests * (self.prefix_blocks + self.suffix_blocks)
        fetched = self.requests * self.request_blocks
        return held + fetched + 16


@attrs.frozen(kw_only=True)
class Request:
    """One consumer request of the demo.

    Attributes:
        consumer: The node that makes it.
        producer: The node that served the conversation it follows up.
        kv_request_id: Its id on the wire.
        keys: Its block keys, in prompt order.
        expect: What each key's lookup should answer.
        pending_resolves: The producer stores its pending blocks in time.
    """

    consumer: int
    producer: int
    kv_request_id: str
    keys: tuple[bytes, ...]
    expect: tuple[Expect, ...]

    def hit_prefix(self) -> int:
        """How many leading blocks the consumer can fetch."""
        n = 0
        for e in self.expect:
            if e not in (Expect.HIT, Expect.PENDING):
                break
            n += 1
        return n


def requests_of(plan: DemoPlan) -> Iterator[Request]:
    """Every request of the run, for every consumer, in a fixed order."""
    for consumer in range(plan.nodes):
        for r in range(plan.requests):
            producer = (consumer + 1 + r % (plan.nodes - 1)) % plan.nodes
            conversation = consumer * plan.requests + r
            system = conversation % plan.system_prompts
            prefix = [f"system {system} block {j}" for j in range(plan.prefix_blocks)]
            suffix = [f"chat {conversation} turn 0 block {j}" for j in range(plan.suffix_blocks)]
            new = [f"chat {conversation} turn 1 block {j}" for j in range(plan.new_blocks)]
            keys = chain_keys(plan.hash_seed, prefix + suffix + new)
            held = [Expect.HIT] * (plan.prefix_blocks + plan.suffix_blocks)
            if plan.expire_every and conversation % plan.expire_every == plan.expire_every - 1:
                held[-1] = Expect.EXPIRE
            elif plan.pending_every and conversation % plan.pending_every == plan.pending_every - 1:
                # Only suffix blocks are pending: prefix blocks are shared.
                n = min(2, plan.suffix_blocks)
                held[-n:] = [Expect.PENDING] * n
            yield Request(
                consumer=consumer,
                producer=producer,
                kv_request_id=f"n{consumer}-r{r}",
                keys=tuple(keys),
                expect=(*held, *[Expect.MISS] * plan.new_blocks),
            )
