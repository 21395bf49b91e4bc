"""Finding the source without a router: fleets of engines on vLLM's own stack, by arm.

The fleets run in one process (:mod:`~p2pactor.programs.bench._fleet_run`); this module
tabulates them and makes their workloads, each request on an engine drawn at random:
chat (:func:`chat_turns`) and RAG (:func:`rag_turns`), keyed as vLLM keys tokens
(``hash_block_tokens``, sha256 chained from ``NONE_HASH``, then ``make_offload_key``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from p2pactor.programs.bench._control_common import child_result, vllm_missing
from p2pactor.programs.bench.cli import BenchOptions, Cell, SectionResult, Stat

TITLE = "finding the source with no router: chat and RAG fleets on vLLM's own stack, by arm"
"""One line saying what is measured."""

ARMS = ("none", "oracle", "auto", "mixed")
"""The arms, in the order they run (:mod:`~p2pactor.programs.bench._fleet_run`)."""

Run = dict[str, Any]
Runs = dict[str, list[Run]]  # arm -> its repeats

FIGURES: tuple[tuple[str, str, float], ...] = (
    ("prefix hit rate (% of prompt tokens)", "hit_rate", 100.0),
    ("prefill tokens saved (k)", "saved_tokens", 1e-3),
    ("  of them loaded from peers (k)", "loaded_tokens", 1e-3),
    ("tokens saved, % of the oracle's", "saved_share", 100.0),
    ("tokens loaded from peers, % of the oracle's", "loaded_share", 100.0),
    ("wait, claimed requests (steps, mean)", "wait_claimed_mean", 1.0),
    ("wait, named requests (steps, mean)", "wait_named_mean", 1.0),
    ("wait, unclaimed requests (steps, max)", "wait_unclaimed_max", 1.0),
    ("hung requests (no answer in 5 s)", "hung", 1.0),
    ("lookups per named request", "lookups_per_named", 1.0),
    ("false claims (% of probed keys)", "false_claim_rate", 100.0),
    ("summary bytes/s per peer pair", "summary_bytes_per_s_per_peer", 1.0),
    ("index entries per engine", "index_claims_per_engine", 1.0),
    ("index memory per engine (KiB)", "index_bytes_per_engine", 1 / 1024),
    ("pins left", "pins_left", 1.0),
    ("blocks with wrong bytes", "wrong_blocks", 1.0),
    ("loads failed", "loads_failed", 1.0),
    ("run time (s)", "seconds", 1.0),
)
"""(row label, key of one run's figures, scale), in table order; a column per arm."""


def plan(quick: bool) -> tuple[dict[str, int], list[tuple[str, int, float]], tuple[str, ...]]:
    """Requests (chat: conversations) per workload, fleets (workload, engines, tier share), arms."""
    if quick:
        return {"chat": 20, "rag": 60}, [("chat", 4, 0.25), ("rag", 5, 0.25)], ("oracle", "auto")
    fleets = [("chat", 4, 0.25), ("chat", 8, 0.25), ("rag", 5, 0.25), ("rag", 5, 0.1)]
    return {"chat": 160, "rag": 480}, fleets, ARMS


def fleet_of(workload: str, engines: int, share: float) -> str:
    """A fleet's name in the rows."""
    tiers = f", tiers {100 * share:g}%" if workload == "rag" else ""
    return f"{workload}, {engines} engines{tiers}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _tabulate(fleet: str, runs: Runs) -> tuple[list[dict[str, Cell]], dict[str, Stat], list[str]]:
    for repeats in runs.values():  # each repeat against the oracle's (the same turns in both)
        for run, oracle in zip(repeats, runs["oracle"], strict=True):
            for key in ("saved", "loaded"):
                base = oracle[f"{key}_tokens"]
                run[f"{key}_share"] = run[f"{key}_tokens"] / base if base else 0.0
    rows: list[dict[str, Cell]] = []
    for label, key, scale in FIGURES:
        row: dict[str, Cell] = {"figure": f"{fleet}: {label}"}
        for arm in ARMS:
            values = [scale * float(run[key]) for run in runs.get(arm, [])]
            row[arm] = Stat.of(values) if values else None
        rows.append(row)
    auto = runs["auto"]
    p2p, saved = (Stat.of(r[f"{key}_share"] for r in auto) for key in ("loaded", "saved"))
    ratios = {
        f"{fleet}: auto/oracle tokens loaded from peers": p2p,
        f"{fleet}: auto/oracle tokens saved": saved,
    }
    probed = sum(r["probed_keys"] for r in auto)
    false = sum(r["false_claims"] for r in auto) / probed if probed else 0.0
    every = [r for arm in ARMS for r in runs.get(arm, [])]
    unclaimed = max(r["wait_unclaimed_max"] for r in every)
    hung = sum(r["hung"] for r in every)
    left = sum(r["pins_left"] + r["open_left"] for r in every)
    wrong = sum(r["wrong_blocks"] for r in every)
    verdicts = [
        (
            f"auto saves {saved.median:.1%} of the oracle's tokens ({p2p.median:.1%} of what it "
            f"loads from peers); target 90%: {_verdict(p2p.median >= 0.9)} on the tokens loaded, "
            f"{_verdict(saved.median >= 0.9)} on all"
        ),
        f"false claims {false:.2%} of probed keys; target 2%: {_verdict(false <= 0.02)}",
        (
            f"requests nobody claims wait at most {unclaimed} extra steps (every arm); target 0: "
            f"{_verdict(unclaimed == 0)}"
        ),
        f"{hung} hung requests in every arm together; target 0: {_verdict(hung == 0)}",
        (
            f"{left} pins or peer requests left, {wrong} blocks with wrong bytes (target 0: "
            f"{_verdict(left == 0 and wrong == 0)})"
        ),
    ]
    notes = [f"{fleet}: {v}" for v in verdicts]
    return rows, ratios, notes


def run(options: BenchOptions) -> SectionResult:
    """Run the fleet benchmark (chat, then RAG) in a subprocess and tabulate its figures."""
    if missing := vllm_missing():
        return SectionResult(skipped=missing)
    repeats = 1 if options.quick else min(3, max(1, options.repeats))
    found = child_result(
        "p2pactor.programs.bench._fleet_run",
        *(str(repeats), *(["--quick"] if options.quick else [])),
        stderr=os.path.join(options.work_dir, "fleet.err"),
        timeout=300 if options.quick else 1800 * repeats,
    )
    parts = [_tabulate(fleet, runs) for fleet, runs in found.items()]
    return SectionResult(
        rows=[row for rows, _, _ in parts for row in rows],
        ratios={k: v for _, ratios, _ in parts for k, v in ratios.items()},
        notes=[note for _, _, notes in parts for note in notes],
    )


# --- the workloads (needing vLLM: run by _fleet_run) -------------------------------------


TOKENS_PER_BLOCK = 16
"""Tokens per block (and per key: one block per chunk), as the benchmark's spec says."""


@dataclass(frozen=True)
class Turn:
    """One request (``index``, in arrival order): a turn of a conversation, on its engine.

    Its prompt's keys, its reply's, the steps the user takes to write it (0 for a first turn).
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
        from vllm.utils.hashing import sha256  # noqa: PLC0415 - vLLM in _fleet_run only
        from vllm.v1.core.kv_cache_utils import hash_block_tokens  # noqa: PLC0415
        from vllm.v1.kv_offload.base import make_offload_key  # noqa: PLC0415

        added = []
        for start in range(0, len(tokens), TOKENS_PER_BLOCK):
            block = tokens[start : start + TOKENS_PER_BLOCK]
            digest = hash_block_tokens(sha256, self._parent, block, None)
            self._parent = digest
            added.append(bytes(make_offload_key(digest, 0)))
        self.keys += added
        return added


def _tokens(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(1, 150_000) for _ in range(blocks * TOKENS_PER_BLOCK)]


def chat_turns(engines: int, conversations: int, seed: int) -> list[Turn]:
    """Every request of a chat run, in arrival order (a conversation's turns in turn order).

    32 system prompts of 16-64 blocks, of Zipf popularity (s = 1), start conversations of
    2-5 turns; a turn's prompt is the whole history (user messages of 2-6 blocks, replies
    of 2-8) and a new message. A follow-up comes 10-40 steps after its reply (real users
    take longer, which only leaves the summaries more time).
    """
    rng = random.Random(seed)  # noqa: S311 - a reproducible workload, not a secret
    systems = [_tokens(rng, rng.randint(16, 64)) for _ in range(32)]
    weights = [1 / (rank + 1) for rank in range(32)]
    timed: list[tuple[float, int, int, tuple[bytes, ...], list[bytes], int]] = []
    for conversation in range(conversations):
        chain = _Chain()
        chain.extend(systems[rng.choices(range(32), weights)[0]])
        at = rng.uniform(0.0, 1.0)
        for turn in range(rng.randint(2, 5)):
            chain.extend(_tokens(rng, rng.randint(2, 6)))
            prompt = tuple(chain.keys)
            reply = chain.extend(_tokens(rng, rng.randint(2, 8)))
            think = rng.randint(10, 40) if turn else 0
            timed.append((at, conversation, turn, prompt, reply, think))
            at += rng.uniform(0.05, 0.3)  # arrival order: the next message comes later
    timed.sort(key=lambda t: (t[0], t[1], t[2]))
    return [
        Turn(i, conversation, turn, rng.randrange(engines), p, tuple(reply), think)
        for i, (_, conversation, turn, p, reply, think) in enumerate(timed)
    ]


def rag_turns(engines: int, requests: int, seed: int) -> list[Turn]:
    """Every request of a RAG run, in arrival order (each its own one-turn conversation).

    A shared system prompt of 4 blocks, a document of 16-64 (64 of Zipf popularity, s = 0.8,
    coming into use over the run; a fifth of the requests one nobody else asks for) and a
    question of 1-4; replies of 2-6.
    """
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
        prompt = tuple(chain.keys)
        reply = chain.extend(_tokens(rng, rng.randint(2, 6)))
        turns.append(Turn(i, i, 0, rng.randrange(engines), prompt, tuple(reply), 0))
    return turns


def working_set(turns: Sequence[Turn]) -> int:
    """Distinct keys the run computes (prompts and replies)."""
    return len({k for t in turns for k in (*t.keys, *t.reply)})
