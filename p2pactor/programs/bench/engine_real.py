"""Real vLLM engines: what B's prefill of prefixes A computed costs, through each P2P tier.

Two real vLLM 0.33.0 engines, each its own process (:mod:`p2pactor.programs.vllmreal`,
CPU platform, a Llama of about 20 M parameters made locally, 1,536-token
prefixes: the prefill shows). Engine A computes every prompt set and serves; a
fresh engine B then runs each set once, naming A as the source, and its time to
first token and generate time are measured. The arms, in one run:
p2pactor's tier on both engines, vLLM's own ``p2p`` tier on both, and no P2P
(B prefills everything). B's tokens must be A's in every arm (the same model,
greedy). The ratios are the arms' medians over the sets, in this run.
"""

from __future__ import annotations

import os
import random
import statistics
from pathlib import Path
from typing import Any

from p2pactor.programs.bench._control_common import spread_ports
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat

NAME = "engine-real"
"""The section's name."""
TITLE = "real vLLM engines: B's prefill of what A computed, through p2pactor, vLLM's tier, none"
"""One line saying what is measured."""

ARMS = ("ours", "stock", "none")


def _prompt_sets(sets: int, per_set: int, prefix: int, own: int) -> list[list[list[int]]]:
    rng = random.Random(11)  # noqa: S311 - a reproducible workload
    return [
        [[rng.randrange(3, 1024) for _ in range(prefix + own)] for _ in range(per_set)]
        for _ in range(sets)
    ]


def _named(port: int, tag: str, n: int) -> list[dict[str, Any] | None]:
    source = {"remote_host": "127.0.0.1", "remote_port": port}
    return [{"remote_kv_source": {"kv_request_id": f"{tag}-{i}", **source}} for i in range(n)]


def _arm(
    arm: str, model: str, sets: list[list[list[int]]], work: Path, cpu_bytes: int
) -> dict[str, Any]:
    """One arm: A computes every set (unless ``none``), a fresh B runs each; B's figures."""
    from p2pactor.programs.vllmreal.client import (  # noqa: PLC0415 - vLLM only here
        EngineOptions,
        EngineProcess,
        tier_entry,
    )

    def options(name: str, port: int) -> EngineOptions:
        return EngineOptions(
            model=model,
            engine_id=f"p2pactor-bench-{name}-{os.getpid()}",
            tier=tier_entry(arm, port),
            cpu_bytes=cpu_bytes,
        )

    a = None
    a_port, b_port = spread_ports(2)
    outputs: list[list[list[int]]] = []
    try:
        if arm != "none":
            a = EngineProcess(options(f"a-{arm}", a_port), work / f"a-{arm}.log")
            outputs = [a.generate(s, max_tokens=8)["tokens"] for s in sets]
        with EngineProcess(options(f"b-{arm}", b_port), work / f"b-{arm}.log") as b:
            runs, warm = [], []
            for i, prompts in enumerate(sets):
                kv = None if arm == "none" else _named(a_port, f"{arm}-{i}", len(prompts))
                runs.append(b.generate(prompts, kv, max_tokens=8))
                if arm == "none":
                    # Again: every block is in B's own KV cache now, no tier
                    # is asked. What no P2P tier can beat: the floor.
                    warm.append(b.generate(prompts, max_tokens=8))
            left = b.stop()
    finally:
        if a is not None:
            left_a = a.stop()
    return {
        "warm": {
            "generate_s": [r["seconds"] for r in warm],
            "ttft_s": [statistics.median(r["ttft"]) for r in warm],
        },
        "generate_s": [r["seconds"] for r in runs],
        "ttft_s": [statistics.median(r["ttft"]) for r in runs],
        "tokens": [r["tokens"] for r in runs],
        "reference": outputs,
        "left": left + (left_a if a is not None else []),
    }


def run(options: BenchOptions) -> SectionResult:
    """Run the three arms in turn and tabulate B's times."""
    from p2pactor.programs.vllmreal import missing  # noqa: PLC0415

    why = missing()
    if why is not None:
        return SectionResult(name=NAME, title=TITLE, skipped=f"no real vLLM engine here: {why}")
    from p2pactor.programs.vllmreal.model import ModelShape, make_model  # noqa: PLC0415

    if options.quick:
        shape, sets, per_set, prefix, own = ModelShape(), 1, 2, 256, 16
    else:
        shape = ModelShape(layers=8, hidden=512, heads=8, intermediate=1024)
        sets, per_set, prefix, own = max(3, min(options.repeats, 5)), 4, 1536, 32
    work = Path(options.work_dir) / "engine-real"
    work.mkdir(parents=True, exist_ok=True)
    model = str(make_model(work / "model", shape))
    prompt_sets = _prompt_sets(sets, per_set, prefix, own)
    chunk = 2 * shape.layers * shape.hidden * 4 * 32  # K and V, float32, a 32-token block
    # Every set stays in A's tier, and one peer may pin a quarter of it
    # (PeerQuotas' default): a tier under four of B's batches would refuse some.
    batch = per_set * ((prefix + own) // 32)
    cpu_bytes = (max(sets, 4) * batch + 64) * chunk
    arms = ("ours",) if options.quick else ARMS  # --quick: the one that must work
    results = {arm: _arm(arm, model, prompt_sets, work, cpu_bytes) for arm in arms}
    reference = results["ours"]["reference"]
    names = {"ours": "p2pactor", "stock": "vLLM's p2p tier", "none": "no P2P"}
    rows: list[dict[str, Cell]] = []
    for arm, r in results.items():
        rows.append(
            {
                "arm": names[arm],
                "B generate (s)": Stat.of(r["generate_s"]),
                "B time to first token (ms)": Stat.of(r["ttft_s"]).scaled(1000),
                "B's tokens are A's": str(r["tokens"] == reference),
                "left in /dev/shm": len(r["left"]),
            }
        )
    if "none" not in results:
        notes = [f"--quick: the p2pactor arm alone, {sets} set(s) of {per_set} prompts"]
        return SectionResult(name=NAME, title=TITLE, rows=rows, notes=notes)
    floor = results["none"]["warm"]
    rows.append(
        {
            "arm": "floor: B's own KV cache",
            "B generate (s)": Stat.of(floor["generate_s"]),
            "B time to first token (ms)": Stat.of(floor["ttft_s"]).scaled(1000),
            "B's tokens are A's": None,
            "left in /dev/shm": None,
        }
    )

    def ratio(key: str, a: str, b: str) -> Stat:
        return Stat.of(x / y for x, y in zip(results[a][key], results[b][key], strict=True))

    def above(key: str) -> Stat:
        # What each tier adds to the floor: fetching, loading, the steps it waits.
        triples = zip(results["ours"][key], results["stock"][key], floor[key], strict=True)
        return Stat.of((o - f) / max(s - f, 1e-6) for o, s, f in triples)

    ratios = {
        "generate time, p2pactor / vLLM's tier": ratio("generate_s", "ours", "stock"),
        "generate time, p2pactor / no P2P": ratio("generate_s", "ours", "none"),
        "generate time, vLLM's tier / no P2P": ratio("generate_s", "stock", "none"),
        "time to first token, p2pactor / vLLM's tier": ratio("ttft_s", "ours", "stock"),
        "time to first token, p2pactor / no P2P": ratio("ttft_s", "ours", "none"),
        "generate time above the floor, p2pactor / vLLM's tier": above("generate_s"),
        "time to first token above the floor, p2pactor / vLLM's tier": above("ttft_s"),
    }
    best = Stat.of(
        f / s for f, s in zip(floor["generate_s"], results["stock"]["generate_s"], strict=True)
    ).median
    ours_stock = ratios["generate time, p2pactor / vLLM's tier"].median
    notes = [
        (
            f"model: {shape.layers} layers, hidden {shape.hidden}, about "
            f"{shape.parameters / 1e6:.0f} M parameters (float32, vLLM's CPU attention); "
            f"{sets} set(s) of {per_set} prompts of {prefix} + {own} tokens, 8 tokens out; "
            f"{chunk >> 10} KiB blocks of 32 tokens; B names A in every request"
        ),
        (
            f"B's generate time with p2pactor is {ours_stock:.2f}x vLLM's tier's; target "
            f"0.6x: {'met' if ours_stock <= 0.6 else 'MISSED'}; a tier that cost nothing "
            f"(the floor) would be {best:.2f}x"
        ),
        (
            f"B fetches {batch} blocks, {batch * chunk / 1e6:.0f} MB, per set; the floor is B "
            "running the set again, every block in its own KV cache"
        ),
    ]
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)
