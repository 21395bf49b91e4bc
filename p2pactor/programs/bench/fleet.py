"""Finding the source without a router: fleets of engines on vLLM's own stack, every arm.

Every engine is vLLM 0.33's own offloading stack
(:mod:`p2pactor.programs.bench._fleet_engine`: ``TieringOffloadingManager``
from ``get_manager()``, its CPU tier with vLLM's LRU and its tier-poll thread,
p2pactor's tier or vLLM's own from the tier entry, stepped as vLLM's connector
scheduler steps it, over real ZeroMQ and NIXL). Two workloads
(:mod:`p2pactor.programs.bench._fleet_workload`): router-less shared-prefix
chat on 4 and 8 engines with each CPU tier a quarter of the working set, and
RAG on 5 engines (Zipf documents coming into use over the run, a fifth of the
requests for a prefix nobody holds) with tiers a quarter and a tenth of it.
The arms (:mod:`p2pactor.programs.bench._fleet_run`): no P2P, an oracle naming
the engine whose CPU tier vLLM says holds the longest prefix, a random peer
named, automatic choice, a mixed fleet (every other engine stock vLLM),
engine 0 silent (no summary), engine 0 hostile (claims keys it does not hold).
Per fleet, the median over repeats with [min..max].
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from p2pactor.programs.bench._control_common import run_module, vllm_missing
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat

NAME = "fleet"
"""The section's name."""
TITLE = "finding the source with no router: chat and RAG fleets on vLLM's own stack, by arm"
"""One line saying what is measured."""

ARMS = ("none", "oracle", "random", "auto", "mixed", "silent", "hostile")

Run = dict[str, Any]
Runs = dict[str, list[Run]]  # arm -> its repeats


def fleet_of(run: Run) -> str:
    """The fleet a run belongs to, as its rows name it."""
    if run.get("workload") == "rag":
        return f"rag, {run['engines']} engines, tiers {100 * run['capacity_share']:g}%"
    return f"chat, {run['engines']} engines"


def _by(key: str) -> Callable[[Run, Runs, int], float]:
    return lambda run, runs, i: float(run[key])


def _share(key: str, of: str) -> Callable[[Run, Runs, int], float]:
    """``run[key]`` as a percentage of arm ``of``'s, in the same repeat."""

    def get(run: Run, runs: Runs, i: int) -> float:
        base = float(runs[of][i][key])
        return 100.0 * float(run[key]) / base if base else 0.0

    return get


def _others(run: Run, runs: Runs, i: int) -> float:
    """Tokens saved by engines 1..n-1 (not engine 0), as a percentage of the auto arm's."""
    base = sum(runs["auto"][i]["saved_by_engine"][1:])
    return 100.0 * sum(run["saved_by_engine"][1:]) / base if base else 0.0


def _per_key(key: str, total: str, scale: float = 100.0) -> Callable[[Run, Runs, int], float]:
    return lambda run, runs, i: scale * run[key] / run[total] if run[total] else 0.0


def _wait(kind: str, stat: str) -> Callable[[Run, Runs, int], float]:
    return lambda run, runs, i: float(run[f"wait_steps_{stat}"][kind])


FIGURES: tuple[tuple[str, Callable[[Run, Runs, int], float]], ...] = (
    ("prefix hit rate (% of prompt tokens)", lambda r, rs, i: 100.0 * r["hit_rate"]),
    ("prefill tokens saved (k)", lambda r, rs, i: r["saved_tokens"] / 1000),
    ("  of them loaded from peers (k)", lambda r, rs, i: r["loaded_tokens"] / 1000),
    ("tokens saved, % of the oracle's", _share("saved_tokens", "oracle")),
    ("tokens loaded from peers, % of the oracle's", _share("loaded_tokens", "oracle")),
    ("saved by engines 1..n-1, % of auto's", _others),
    ("wait, claimed requests (steps, mean)", _wait("claimed", "mean")),
    ("wait, named requests (steps, mean)", _wait("named", "mean")),
    ("wait, unclaimed requests (steps, max)", _wait("unclaimed", "max")),
    ("hung requests (no answer in 5 s)", _by("hung")),
    ("lookups per named request", _per_key("lookups_sent", "named", 1.0)),
    ("probes per request", _by("probes_per_request")),
    ("false claims (% of probed keys)", _per_key("false_claims", "probed_keys")),
    ("summary bytes/s per peer pair", _by("summary_bytes_per_s_per_peer")),
    ("index entries per engine", _by("index_claims_per_engine")),
    ("index memory per engine (KiB)", lambda r, rs, i: r["index_bytes_per_engine"] / 1024),
    ("pins left", _by("pins_left")),
    ("blocks with wrong bytes", _by("wrong_blocks")),
    ("loads failed", _by("loads_failed")),
    ("run time (s)", _by("seconds")),
)
"""(row label, the figure of one run), in table order; a column per arm."""


def _stat(values: list[float]) -> Stat | None:
    return Stat.of(values) if values else None


def _rows(fleet: str, runs: Runs) -> list[dict[str, Cell]]:
    rows: list[dict[str, Cell]] = []
    for label, get in FIGURES:
        row: dict[str, Cell] = {"figure": f"{fleet}: {label}"}
        for arm in ARMS:
            row[arm] = _stat([get(run, runs, i) for i, run in enumerate(runs.get(arm, []))])
        rows.append(row)
    return rows


def _ratios(size: str, runs: Runs) -> dict[str, Stat]:
    def per_repeat(get: Callable[[Run, Runs, int], float], arm: str) -> Stat:
        return Stat.of(get(run, runs, i) / 100.0 for i, run in enumerate(runs[arm]))

    ratios = {
        f"{size}: auto/oracle tokens loaded from peers": per_repeat(
            _share("loaded_tokens", "oracle"), "auto"
        ),
        f"{size}: auto/oracle tokens saved": per_repeat(_share("saved_tokens", "oracle"), "auto"),
    }
    if "hostile" in runs and "silent" in runs:
        ratios[f"{size}: others' savings with a hostile engine 0 / with a silent one"] = Stat.of(
            sum(h["saved_by_engine"][1:]) / max(1, sum(s["saved_by_engine"][1:]))
            for h, s in zip(runs["hostile"], runs["silent"], strict=True)
        )
    return ratios


def _median(runs: list[Run], get: Callable[[Run], float]) -> float:
    return Stat.of(get(r) for r in runs).median


def _notes(fleets: dict[str, Runs], repeats: int, args: dict[str, Any]) -> list[str]:
    notes = [
        (
            f"chat: {args['conversations']} conversations of 2-5 turns; rag: {args['requests']} "
            f"requests over Zipf documents, a fifth for a prefix nobody holds; {repeats} "
            "repeat(s); 10 ms steps, 4 requests admitted per step over the fleet, 4 in flight "
            "per engine; every engine is vLLM's own stack (its LRU, no touch)"
        ),
        (
            "tokens saved: prompt tokens not prefilled (loaded from the engine's own CPU tier, "
            "or from a peer through it); the oracle names the engine whose CPU tier (vLLM's "
            "own lookup) holds the longest prefix at admission; a hung request waited 5 s for "
            "its lookups and was given up (as a client would)"
        ),
    ]
    for fleet, runs in fleets.items():
        notes += _fleet_notes(fleet, runs)
    return notes


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _fleet_notes(fleet: str, runs: Runs) -> list[str]:
    auto = runs["auto"]

    def share(figure: str) -> float:
        # Each repeat's own ratio (the same turns in both arms), then their median.
        get = _share(figure, "oracle")
        return Stat.of(get(r, runs, i) / 100.0 for i, r in enumerate(auto)).median

    p2p, saved = share("loaded_tokens"), share("saved_tokens")
    probed = sum(r["probed_keys"] for r in auto)
    false = sum(r["false_claims"] for r in auto) / probed if probed else 0.0
    arms = [a for a in ARMS if a in runs]
    unclaimed = max(r["wait_steps_max"]["unclaimed"] for a in arms for r in runs[a])
    hung = sum(r["hung"] for a in arms for r in runs[a])
    left = sum(r["pins_left"] + r["open_left"] for a in arms for r in runs[a])
    wrong = sum(r["wrong_blocks"] for a in arms for r in runs[a])
    notes = [
        (
            f"{fleet}: auto saves {saved:.1%} of the oracle's tokens ({p2p:.1%} of what it "
            f"loads from peers); target 90%: {_verdict(p2p >= 0.9)} on the tokens loaded, "
            f"{_verdict(saved >= 0.9)} on all"
        ),
        f"{fleet}: false claims {false:.2%} of probed keys; target 2%: {_verdict(false <= 0.02)}",
        (
            f"{fleet}: requests nobody claims wait at most {unclaimed} extra steps (every arm); "
            f"target 0: {_verdict(unclaimed == 0)}"
        ),
        f"{fleet}: {hung} hung requests in every arm together; target 0: {_verdict(hung == 0)}",
        (
            f"{fleet}: {left} pins or peer requests left, {wrong} blocks with wrong bytes "
            f"(target 0: {_verdict(left == 0 and wrong == 0)})"
        ),
    ]
    if "hostile" in runs and "silent" in runs:
        hostile = [sum(r["saved_by_engine"][1:]) for r in runs["hostile"]]
        silent = [sum(r["saved_by_engine"][1:]) for r in runs["silent"]]
        honest = [sum(r["saved_by_engine"][1:]) for r in auto]
        cost_silent = 1 - Stat.of(h / s for h, s in zip(hostile, silent, strict=True)).median
        cost_auto = 1 - Stat.of(h / a for h, a in zip(hostile, honest, strict=True)).median
        caught = _median(runs["hostile"], lambda r: r["hostile_quarantined_by"])
        peers = runs["hostile"][0]["engines"] - 1
        notes.append(
            f"{fleet}: the hostile engine is quarantined by {caught:g} of {peers} peers; it "
            f"costs the others {cost_silent:.1%} of their savings against a silent engine 0, "
            f"{cost_auto:.1%} against an honest one; target 5%: "
            f"{_verdict(cost_silent <= 0.05)} against silent"
        )
    return notes


def run(options: BenchOptions) -> SectionResult:
    """Run the fleet benchmark (chat, then RAG) in a subprocess and tabulate its figures."""
    missing = vllm_missing()
    if missing is not None:
        return SectionResult(name=NAME, title=TITLE, skipped=missing)
    repeats = 1 if options.quick else min(3, max(1, options.repeats))
    conversations = 20 if options.quick else 160
    requests = 60 if options.quick else 480
    out = os.path.join(options.work_dir, "fleet.json")
    # --quick: one fleet per workload, the arms the ratios need.
    smoke = ["--chat-sizes=4", "--capacities=0.25", "--arms=oracle,auto"] if options.quick else []
    run_module(
        "p2pactor.programs.bench._fleet_run",
        f"--json={out}",
        f"--repeats={repeats}",
        f"--conversations={conversations}",
        f"--requests={requests}",
        *smoke,
        timeout=300 if options.quick else 1800 * repeats,
    )
    with open(out) as f:
        runs: list[Run] = json.load(f)["runs"]
    fleets: dict[str, Runs] = {}
    for r in runs:
        fleets.setdefault(fleet_of(r), {}).setdefault(r["arm"], []).append(r)
    rows = [row for fleet, by_arm in fleets.items() for row in _rows(fleet, by_arm)]
    ratios = {k: v for fleet, by_arm in fleets.items() for k, v in _ratios(fleet, by_arm).items()}
    notes = _notes(fleets, repeats, {"conversations": conversations, "requests": requests})
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)
