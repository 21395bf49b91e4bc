"""Finding the source without a router: a fleet of scripted vLLM engines, every arm in one run.

Router-less shared-prefix chat (:mod:`p2pactor.programs.bench._fleet_workload`:
32 system prompts of Zipf popularity, multi-turn conversations whose history
re-enters as prompt, vLLM's key hashing over synthetic token ids, every turn
on a uniformly random engine, each engine's CPU tier a quarter of the
working set) on 4 and then 8 engines
(:mod:`p2pactor.programs.bench._fleet_engine`: the real vLLM adapter, or
vLLM 0.33's own tier, over real ZeroMQ and NIXL). The arms
(:mod:`p2pactor.programs.bench._fleet_run`): no P2P, an oracle naming the
engine with the longest prefix, a random peer named, automatic choice, a
mixed fleet (every other engine stock vLLM), engine 0 silent (no summary),
engine 0 hostile (claims every key). Per fleet size, the median over repeats
with [min..max].
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from p2pactor.programs.bench._control_common import run_module, vllm_missing
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat

__all__ = ["NAME", "TITLE", "run"]

NAME = "fleet"
"""The section's name."""
TITLE = "finding the source with no router: router-less chat on 4 and 8 engines, by arm"
"""One line saying what is measured."""

ARMS = ("none", "oracle", "random", "auto", "mixed", "silent", "hostile")

Run = dict[str, Any]
Runs = dict[str, list[Run]]  # arm -> its repeats


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


def _rows(size: int, runs: Runs) -> list[dict[str, Cell]]:
    rows: list[dict[str, Cell]] = []
    for label, get in FIGURES:
        row: dict[str, Cell] = {"figure": f"{size} engines: {label}"}
        for arm in ARMS:
            row[arm] = _stat([get(run, runs, i) for i, run in enumerate(runs.get(arm, []))])
        rows.append(row)
    return rows


def _ratios(size: int, runs: Runs) -> dict[str, Stat]:
    def per_repeat(get: Callable[[Run, Runs, int], float], arm: str) -> Stat:
        return Stat.of(get(run, runs, i) / 100.0 for i, run in enumerate(runs[arm]))

    return {
        f"{size} engines: auto/oracle tokens loaded from peers": per_repeat(
            _share("loaded_tokens", "oracle"), "auto"
        ),
        f"{size} engines: auto/oracle tokens saved": per_repeat(
            _share("saved_tokens", "oracle"), "auto"
        ),
        f"{size} engines: others' savings with a hostile engine 0 / with a silent one": Stat.of(
            sum(h["saved_by_engine"][1:]) / max(1, sum(s["saved_by_engine"][1:]))
            for h, s in zip(runs["hostile"], runs["silent"], strict=True)
        ),
    }


def _median(runs: list[Run], get: Callable[[Run], float]) -> float:
    return Stat.of(get(r) for r in runs).median


def _notes(sizes: dict[int, Runs], repeats: int, args: dict[str, Any]) -> list[str]:
    notes = [
        (
            f"{args['conversations']} conversations of 2-5 turns, {repeats} repeat(s); each "
            "engine's CPU tier holds 25% of the working set (LRU); 10 ms steps, 4 requests "
            "admitted per step over the fleet, 4 in flight per engine; a follow-up comes "
            "10-40 steps after its reply"
        ),
        (
            "tokens saved: prompt tokens not prefilled (the engine's own CPU tier, then keys "
            "loaded from a peer); the oracle reads every engine's CPU tier at admission"
        ),
    ]
    for size, runs in sizes.items():
        auto, oracle = runs["auto"], runs["oracle"]
        p2p = _median(auto, lambda r: r["loaded_tokens"]) / max(
            1.0, _median(oracle, lambda r: r["loaded_tokens"])
        )
        saved = _median(auto, lambda r: r["saved_tokens"]) / max(
            1.0, _median(oracle, lambda r: r["saved_tokens"])
        )
        probed = sum(r["probed_keys"] for r in auto)
        false = sum(r["false_claims"] for r in auto) / probed if probed else 0.0
        unclaimed = max(r["wait_steps_max"]["unclaimed"] for a in ARMS for r in runs[a])
        hostile = [sum(r["saved_by_engine"][1:]) for r in runs["hostile"]]
        silent = [sum(r["saved_by_engine"][1:]) for r in runs["silent"]]
        honest = [sum(r["saved_by_engine"][1:]) for r in auto]
        cost_silent = 1 - Stat.of(h / s for h, s in zip(hostile, silent, strict=True)).median
        cost_auto = 1 - Stat.of(h / a for h, a in zip(hostile, honest, strict=True)).median
        caught = _median(runs["hostile"], lambda r: r["hostile_quarantined_by"])
        left = sum(r["pins_left"] + r["open_left"] for a in ARMS for r in runs[a])
        wrong = sum(r["wrong_blocks"] for a in ARMS for r in runs[a])

        def verdict(ok: bool) -> str:
            return "met" if ok else "MISSED"

        notes += [
            (
                f"{size} engines: auto saves {saved:.1%} of the oracle's tokens "
                f"({p2p:.1%} of what it loads from peers); target 90%: "
                f"{verdict(p2p >= 0.9)} on the tokens loaded, {verdict(saved >= 0.9)} on all"
            ),
            (
                f"{size} engines: false claims {false:.2%} of probed keys; target 2%: "
                f"{verdict(false <= 0.02)}"
            ),
            (
                f"{size} engines: requests nobody claims wait at most {unclaimed} extra steps "
                f"(every arm); target 0: {verdict(unclaimed == 0)}"
            ),
            (
                f"{size} engines: the hostile engine is quarantined by {caught:g} of {size - 1} "
                f"peers (the others scored it out before quarantine); it costs the others "
                f"{cost_silent:.1%} of their savings against a silent engine 0, "
                f"{cost_auto:.1%} against an honest one (it is no source once caught); "
                f"target 5%: {verdict(cost_silent <= 0.05)} against silent"
            ),
            (
                f"{size} engines: {left} pins or peer requests left, {wrong} blocks with wrong "
                f"bytes (target 0: {verdict(left == 0 and wrong == 0)})"
            ),
        ]
    return notes


def run(options: BenchOptions) -> SectionResult:
    """Run the fleet benchmark in a subprocess and tabulate its figures."""
    missing = vllm_missing()
    if missing is not None:
        return SectionResult(name=NAME, title=TITLE, skipped=missing)
    repeats = 1 if options.quick else min(3, max(1, options.repeats))
    conversations = 40 if options.quick else 160
    out = os.path.join(options.work_dir, "fleet.json")
    run_module(
        "p2pactor.programs.bench._fleet_run",
        f"--json={out}",
        f"--conversations={conversations}",
        f"--repeats={repeats}",
        timeout=300 if options.quick else 900 * repeats,
    )
    with open(out) as f:
        report = json.load(f)
    sizes: dict[int, Runs] = {}
    for r in report["runs"]:
        sizes.setdefault(int(r["engines"]), {}).setdefault(r["arm"], []).append(r)
    rows = [row for size, runs in sizes.items() for row in _rows(size, runs)]
    ratios = {k: v for size, runs in sizes.items() for k, v in _ratios(size, runs).items()}
    notes = _notes(sizes, repeats, {"conversations": conversations})
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)
