"""The fleet benchmark's workloads: router-less chat and RAG, with vLLM's key hashing.

**Chat** (:class:`FleetPlan`, :func:`turns_of`). A few dozen system prompts,
of Zipf popularity, start the conversations; each conversation has a few
turns, and every turn's prompt is the system prompt, the whole history (every
earlier user message and reply) and a new user message, so a follow-up's
prefix is the previous turn's prompt and reply.
Every turn goes to an engine drawn uniformly at random: no router.

**RAG** (:class:`RagPlan`, :func:`rag_turns_of`). Every prompt is a shared
system prompt, a retrieved document and a question; documents are of Zipf
popularity and come into use over the run (a document's first request comes
while others are asked about older ones), a fifth of the requests retrieve a
document nobody else ever asks for (a prefix nobody holds), and each request
lands on an engine drawn uniformly at random.

Token ids are synthetic (seeded), every segment a whole number of 16-token
blocks; the keys are vLLM's: ``hash_block_tokens`` with sha256 chained from
``NONE_HASH``, then ``make_offload_key(hash, 0)``. Importing it needs vLLM
(the caller has seeded ``NONE_HASH``, as an engine does at start-up).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import attrs
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm.v1.kv_offload.base import make_offload_key

TOKENS_PER_BLOCK = 16
"""Tokens per block (and per key: one block per chunk), as the benchmark's spec says."""


@attrs.frozen(kw_only=True)
class FleetPlan:
    """The shape of one fleet run's workload.

    Attributes:
        engines: Engines in the fleet.
        conversations: Conversations, each a few turns.
        turns: (fewest, most) turns of a conversation.
        system_prompts: Shared system prompts.
        zipf_s: Popularity skew of the system prompts (rank ``r`` weighs ``1 / r**s``).
        system_blocks: (fewest, most) blocks of a system prompt.
        user_blocks: (fewest, most) blocks of a user message.
        reply_blocks: (fewest, most) blocks of a reply.
        think_steps: (fewest, most) engine steps a user takes to write a
            follow-up after the reply (at 10 ms a step, 0.1 to 0.4 s: users
            take longer, which only leaves the summaries more time).
        capacity: Each engine's CPU tier holds this share of the working set.
        seed: Seeds everything.
    """

    engines: int = 4
    conversations: int = 160
    turns: tuple[int, int] = (2, 5)
    system_prompts: int = 32
    zipf_s: float = 1.0
    system_blocks: tuple[int, int] = (16, 64)
    user_blocks: tuple[int, int] = (2, 6)
    reply_blocks: tuple[int, int] = (2, 8)
    think_steps: tuple[int, int] = (10, 40)
    capacity: float = 0.25
    seed: int = 0


@dataclass(frozen=True)
class Turn:
    """One request: a turn of a conversation, on the engine it landed on.

    Attributes:
        index: Its place in arrival order.
        conversation: The conversation it belongs to.
        turn: Which turn (0 is the first).
        engine: The engine it landed on.
        keys: Its prompt's keys, in order.
        reply: The keys of the reply it generates (the next turn's history).
        think_steps: Engine steps the user takes, after the previous turn
            ended, to write this one (none for a first turn).
    """

    index: int
    conversation: int
    turn: int
    engine: int
    keys: tuple[bytes, ...]
    reply: tuple[bytes, ...]
    think_steps: int


class _Chain:
    """vLLM's block-hash chain over token ids, extended one segment at a time."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self._parent: bytes | None = None

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        added = []
        for start in range(0, len(tokens), TOKENS_PER_BLOCK):
            block = tokens[start : start + TOKENS_PER_BLOCK]
            digest = hash_block_tokens(sha256, self._parent, block, None)
            self._parent = digest
            added.append(bytes(make_offload_key(digest, 0)))
        self.keys += added
        return added

    def copy(self) -> _Chain:
        other = _Chain()
        other.keys, other._parent = list(self.keys), self._parent
        return other


def _tokens(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(1, 150_000) for _ in range(blocks * TOKENS_PER_BLOCK)]


def turns_of(plan: FleetPlan) -> list[Turn]:
    """Every request of the run, in arrival order (a conversation's turns in turn order)."""
    rng = random.Random(plan.seed)  # noqa: S311 - a reproducible workload, not a secret
    systems = [_tokens(rng, rng.randint(*plan.system_blocks)) for _ in range(plan.system_prompts)]
    weights = [1 / (rank + 1) ** plan.zipf_s for rank in range(plan.system_prompts)]
    timed: list[tuple[float, int, int, _Chain, list[bytes], int]] = []
    for conversation in range(plan.conversations):
        chain = _Chain()
        chain.extend(systems[rng.choices(range(plan.system_prompts), weights)[0]])
        at = rng.uniform(0.0, 1.0)
        for turn in range(rng.randint(*plan.turns)):
            chain.extend(_tokens(rng, rng.randint(*plan.user_blocks)))
            prompt = chain.copy()
            reply = chain.extend(_tokens(rng, rng.randint(*plan.reply_blocks)))
            think = rng.randint(*plan.think_steps) if turn else 0
            timed.append((at, conversation, turn, prompt, reply, think))
            at += rng.uniform(0.05, 0.3)  # arrival order: the next message comes later
    timed.sort(key=lambda t: (t[0], t[1], t[2]))
    return [
        Turn(i, conversation, turn, rng.randrange(plan.engines), tuple(p.keys), tuple(reply), think)
        for i, (_, conversation, turn, p, reply, think) in enumerate(timed)
    ]


def working_set(turns: Sequence[Turn]) -> int:
    """Distinct keys the run computes (prompts and replies)."""
    return len({k for t in turns for k in (*t.keys, *t.reply)})


@attrs.frozen(kw_only=True)
class RagPlan:
    """The shape of one RAG run's workload.

    Attributes:
        engines: Engines in the fleet.
        requests: Requests in the run.
        documents: Documents that several requests retrieve.
        zipf_s: Their popularity skew (rank ``r`` weighs ``1 / r**s``).
        system_blocks: Blocks of the shared system prompt.
        document_blocks: (fewest, most) blocks of a document.
        question_blocks: (fewest, most) blocks of a question.
        reply_blocks: (fewest, most) blocks of a reply.
        unique_share: Requests retrieving a document nobody else asks for.
        capacity: Each engine's CPU tier holds this share of the working set.
        seed: Seeds everything.
    """

    engines: int = 5
    requests: int = 480
    documents: int = 64
    zipf_s: float = 0.8
    system_blocks: int = 4
    document_blocks: tuple[int, int] = (16, 64)
    question_blocks: tuple[int, int] = (1, 4)
    reply_blocks: tuple[int, int] = (2, 6)
    unique_share: float = 0.2
    capacity: float = 0.25
    seed: int = 0


def rag_turns_of(plan: RagPlan) -> list[Turn]:
    """Every request of a RAG run, in arrival order (each its own one-turn conversation)."""
    rng = random.Random(plan.seed)  # noqa: S311 - a reproducible workload, not a secret
    system = _tokens(rng, plan.system_blocks)
    docs = [_tokens(rng, rng.randint(*plan.document_blocks)) for _ in range(plan.documents)]
    # Document d comes into use a d-th of the way into the run: before it,
    # requests ask about the documents already in use.
    opens = [int(plan.requests * 0.8 * d / plan.documents) for d in range(plan.documents)]
    weights = [1 / (rank + 1) ** plan.zipf_s for rank in range(plan.documents)]
    turns = []
    for i in range(plan.requests):
        if rng.random() < plan.unique_share:
            document = _tokens(rng, rng.randint(*plan.document_blocks))
        else:
            live = [d for d in range(plan.documents) if opens[d] <= i] or [0]
            document = docs[rng.choices(live, [weights[d] for d in live])[0]]
        chain = _Chain()
        chain.extend(system)
        chain.extend(document)
        chain.extend(_tokens(rng, rng.randint(*plan.question_blocks)))
        prompt = chain.copy()
        reply = chain.extend(_tokens(rng, rng.randint(*plan.reply_blocks)))
        engine = rng.randrange(plan.engines)
        turns.append(Turn(i, i, 0, engine, tuple(prompt.keys), tuple(reply), 0))
    return turns
