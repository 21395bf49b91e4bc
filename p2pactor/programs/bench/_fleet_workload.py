"""The fleet benchmark's workloads: router-less chat and RAG, with vLLM's key hashing.

**Chat** (:func:`chat_turns`). 32 system prompts of 16-64 blocks, of Zipf
popularity (s = 1), start the conversations; each has 2-5 turns, and every turn's
prompt is the system prompt, the whole history (every earlier user message of 2-6
blocks and reply of 2-8) and a new user message, so a follow-up's prefix is the
previous turn's prompt and reply. A user takes 10-40 engine steps to write a
follow-up after the reply (0.1-0.4 s at 10 ms a step: users take longer, which only
leaves the summaries more time).

**RAG** (:func:`rag_turns`). Every prompt is a shared system prompt of 4 blocks, a
retrieved document of 16-64 and a question of 1-4; the 64 documents are of Zipf
popularity (s = 0.8) and come into use over the run (document d a d-th of the way
into its first 80%), and a fifth of the requests retrieve a document nobody else
ever asks for (a prefix nobody holds). Replies are 2-6 blocks.

Every request lands on an engine drawn uniformly at random: no router. Token ids
are synthetic (seeded), every segment a whole number of 16-token blocks; the keys
are vLLM's: ``hash_block_tokens`` with sha256 chained from ``NONE_HASH``, then
``make_offload_key(hash, 0)``. Importing it needs vLLM (the caller has seeded
``NONE_HASH``, as an engine does at start-up).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm.v1.kv_offload.base import make_offload_key

TOKENS_PER_BLOCK = 16
"""Tokens per block (and per key: one block per chunk), as the benchmark's spec says."""


@dataclass(frozen=True)
class Turn:
    """One request: a turn of a conversation, on the engine it landed on.

    Attributes:
        index: Its place in arrival order.
        conversation: The conversation it belongs to (a RAG request is its own).
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


def chat_turns(engines: int, conversations: int, seed: int) -> list[Turn]:
    """Every request of a chat run, in arrival order (a conversation's turns in turn order)."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not a secret
    systems = [_tokens(rng, rng.randint(16, 64)) for _ in range(32)]
    weights = [1 / (rank + 1) for rank in range(32)]
    timed: list[tuple[float, int, int, _Chain, list[bytes], int]] = []
    for conversation in range(conversations):
        chain = _Chain()
        chain.extend(systems[rng.choices(range(32), weights)[0]])
        at = rng.uniform(0.0, 1.0)
        for turn in range(rng.randint(2, 5)):
            chain.extend(_tokens(rng, rng.randint(2, 6)))
            prompt = chain.copy()
            reply = chain.extend(_tokens(rng, rng.randint(2, 8)))
            think = rng.randint(10, 40) if turn else 0
            timed.append((at, conversation, turn, prompt, reply, think))
            at += rng.uniform(0.05, 0.3)  # arrival order: the next message comes later
    timed.sort(key=lambda t: (t[0], t[1], t[2]))
    return [
        Turn(i, conversation, turn, rng.randrange(engines), tuple(p.keys), tuple(reply), think)
        for i, (_, conversation, turn, p, reply, think) in enumerate(timed)
    ]


def rag_turns(engines: int, requests: int, seed: int) -> list[Turn]:
    """Every request of a RAG run, in arrival order (each its own one-turn conversation)."""
    rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not a secret
    system = _tokens(rng, 4)
    docs = [_tokens(rng, rng.randint(16, 64)) for _ in range(64)]
    # Document d comes into use a d-th of the way into the run: before it,
    # requests ask about the documents already in use.
    opens = [int(requests * 0.8 * d / 64) for d in range(64)]
    weights = [1 / (rank + 1) ** 0.8 for rank in range(64)]
    turns = []
    for i in range(requests):
        if rng.random() < 0.2:
            document = _tokens(rng, rng.randint(16, 64))
        else:
            live = [d for d in range(64) if opens[d] <= i] or [0]
            document = docs[rng.choices(live, [weights[d] for d in live])[0]]
        chain = _Chain()
        chain.extend(system)
        chain.extend(document)
        chain.extend(_tokens(rng, rng.randint(1, 4)))
        prompt = chain.copy()
        reply = chain.extend(_tokens(rng, rng.randint(2, 6)))
        turns.append(Turn(i, i, 0, rng.randrange(engines), tuple(prompt.keys), tuple(reply), 0))
    return turns


def working_set(turns: Sequence[Turn]) -> int:
    """Distinct keys the run computes (prompts and replies)."""
    return len({k for t in turns for k in (*t.keys, *t.reply)})
