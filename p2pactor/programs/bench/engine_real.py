"""Real vLLM engines: what B's prefill of prefixes A computed costs, through each P2P tier.

Two real vLLM 0.33.0 engines (:mod:`p2pactor.programs.vllmreal`, CPU platform, a small
Llama made locally): A computes every prompt set, a fresh B runs each naming A, through
p2pactor's tier, vLLM's own ``p2p`` tier or none; B's tokens must be A's (greedy).
"""

from __future__ import annotations

import os
import random
import statistics
from pathlib import Path
from typing import Any

from p2pactor.programs.bench._control_common import spread_ports
from p2pactor.programs.bench.cli import BenchOptions, Cell, SectionResult, Stat

TITLE = "real vLLM engines: B's prefill of what A computed, through p2pactor, vLLM's tier, none"
"""One line saying what is measured."""

ARMS = {"ours": "p2pactor", "stock": "vLLM's p2p tier", "none": "no P2P"}
"""Each arm's tier (``ours``, ``stock``: :func:`~p2pactor.programs.vllmreal.client.tier_entry`'s
kinds; ``none``: no P2P) and row name."""


def _times(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    return {
        "generate_s": [r["seconds"] for r in runs],
        "ttft_s": [statistics.median(r["ttft"]) for r in runs],
    }


def _arm(
    arm: str, model: str, sets: list[list[list[int]]], work: Path, cpu_bytes: int
) -> dict[str, Any]:
    """One arm: A computes every set (unless ``none``), a fresh B runs each; B's figures."""
    from p2pactor.programs.vllmreal.client import (  # noqa: PLC0415 - vLLM only here
        EngineOptions,
        EngineProcess,
        tier_entry,
    )

    def engine(name: str, port: int) -> EngineProcess:
        options = EngineOptions(
            model=model,
            engine_id=f"p2pactor-bench-{name}-{arm}-{os.getpid()}",
            tier=tier_entry(arm, port),
            cpu_bytes=cpu_bytes,
        )
        return EngineProcess(options, work / f"{name}-{arm}.log")

    a = None
    a_port, b_port = spread_ports(2)
    source = {"remote_host": "127.0.0.1", "remote_port": a_port}
    outputs: list[list[list[int]]] = []
    left: list[Any] = []
    try:
        if arm != "none":
            a = engine("a", a_port)
            outputs = [a.generate(s, max_tokens=8)["tokens"] for s in sets]
        with engine("b", b_port) as b:
            runs, warm = [], []
            for i, prompts in enumerate(sets):
                kv: list[dict[str, Any] | None] = [
                    {"remote_kv_source": {"kv_request_id": f"{arm}-{i}-{j}", **source}}
                    for j in range(len(prompts))
                ]
                runs.append(b.generate(prompts, None if arm == "none" else kv, max_tokens=8))
                if arm == "none":
                    # Again: every block is in B's own KV cache now, no tier
                    # is asked. What no P2P tier can beat: the floor.
                    warm.append(b.generate(prompts, max_tokens=8))
            left += b.stop()
    finally:
        if a is not None:
            left += a.stop()
    return _times(runs) | {
        "warm": _times(warm),
        "tokens": [r["tokens"] for r in runs],
        "reference": outputs,
        "left": left,
    }


def run(options: BenchOptions) -> SectionResult:
    """Run the three arms in turn and tabulate B's times."""
    from p2pactor.programs.vllmreal import missing  # noqa: PLC0415

    why = missing()
    if why is not None:
        return SectionResult(skipped=f"no real vLLM engine here: {why}")
    from p2pactor.programs.vllmreal.model import ModelShape, make_model  # noqa: PLC0415

    if options.quick:
        shape, sets, per_set, prefix, own = ModelShape(), 1, 2, 256, 16
    else:
        shape = ModelShape(layers=8, hidden=512, heads=8, intermediate=1024)
        sets, per_set, prefix, own = max(3, min(options.repeats, 5)), 4, 1536, 32
    work = Path(options.work_dir) / "engine-real"
    work.mkdir(parents=True, exist_ok=True)
    model = str(make_model(work / "model", shape))
    rng = random.Random(11)  # noqa: S311 - a reproducible workload
    prompt_sets = [
        [[rng.randrange(3, 1024) for _ in range(prefix + own)] for _ in range(per_set)]
        for _ in range(sets)
    ]
    chunk = 2 * shape.layers * shape.hidden * 4 * 32  # K and V, float32, a 32-token block
    # Every set stays in A's tier, and one peer may pin a quarter of it
    # (PeerQuotas' default): a tier under four of B's batches would refuse some.
    batch = per_set * ((prefix + own) // 32)
    cpu_bytes = (max(sets, 4) * batch + 64) * chunk
    arms = ["ours"] if options.quick else list(ARMS)  # --quick: the one that must work
    results = {arm: _arm(arm, model, prompt_sets, work, cpu_bytes) for arm in arms}
    reference = results["ours"]["reference"]
    floor = results["none"]["warm"] if "none" in results else None

    def row(name: str, r: dict[str, Any], same: str | None, left: int | None) -> dict[str, Cell]:
        return {
            "arm": name,
            "B generate (s)": Stat.of(r["generate_s"]),
            "B time to first token (ms)": Stat.of(t * 1e3 for t in r["ttft_s"]),
            "B's tokens are A's": same,
            "left in /dev/shm": left,
        }

    rows = [
        row(ARMS[a], r, str(r["tokens"] == reference), len(r["left"])) for a, r in results.items()
    ]
    if floor is None:  # --quick: the p2pactor arm alone
        return SectionResult(rows=rows)

    def over(key: str, a: str, b: str) -> Stat:
        return Stat.of(x / y for x, y in zip(results[a][key], results[b][key], strict=True))

    def above(key: str) -> Stat:
        # What each tier adds to the floor: fetching, loading, the steps it waits.
        triples = zip(results["ours"][key], results["stock"][key], floor[key], strict=True)
        return Stat.of((o - f) / max(s - f, 1e-6) for o, s, f in triples)

    rows.append(row("floor: B's own KV cache", floor, None, None))
    ratios: dict[str, Stat] = {}
    for key, what in (("generate_s", "generate time"), ("ttft_s", "time to first token")):
        ratios[f"{what}, p2pactor / vLLM's tier"] = over(key, "ours", "stock")
        ratios[f"{what}, p2pactor / no P2P"] = over(key, "ours", "none")
        ratios[f"{what} above the floor, p2pactor / vLLM's tier"] = above(key)
    pairs = zip(floor["generate_s"], results["stock"]["generate_s"], strict=True)
    best = statistics.median(f / s for f, s in pairs)
    ours_stock = ratios["generate time, p2pactor / vLLM's tier"].median
    notes = [
        (
            f"B's generate time with p2pactor is {ours_stock:.2f}x vLLM's tier's; target "
            f"0.6x: {'met' if ours_stock <= 0.6 else 'MISSED'}; a tier that cost nothing "
            f"(the floor) would be {best:.2f}x"
        ),
    ]
    return SectionResult(rows=rows, ratios=ratios, notes=notes)
