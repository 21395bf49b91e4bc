"""``p2pactor bench [--quick] [--json PATH] [--only SECTION ...]``."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any

from p2pactor.programs.bench.report import REPORT_VERSION, BenchOptions, SectionResult, machine

if TYPE_CHECKING:
    from collections.abc import Sequence


SECTIONS: tuple[str, ...] = (
    "dataplane",
    "control",
    "engine",
    "scale",
    "hosts",
    "fleet",
    "engine-real",
    "index-scale",
    "summary-attack",
)
"""Section names, in the order they run; each is the module ``p2pactor.programs.bench.<name>``
(a ``-`` in the name is a ``_`` in the module's)."""


def _load(name: str) -> Any:
    """A section's module (the tests put a fake section in its place)."""
    return importlib.import_module(f"p2pactor.programs.bench.{name.replace('-', '_')}")


def run_bench(
    options: BenchOptions, only: Sequence[str] = (), *, out: Any = sys.stdout
) -> dict[str, Any]:
    """Run the sections (all, or ``only``), print each table; the JSON document of the run."""
    results: list[dict[str, Any]] = []
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    where = machine()  # before the sections: its load average is the one they started at
    for name in SECTIONS:
        if only and name not in only:
            continue
        section = _load(name)
        t0 = time.perf_counter()
        try:
            result = section.run(options)
        except Exception as exc:  # one broken section must not hide the others
            traceback.print_exc(file=sys.stderr)
            result = SectionResult(
                name=name, title=section.TITLE, skipped=f"failed: {type(exc).__name__}: {exc}"
            )
        results.append(result.to_json() | {"seconds": round(time.perf_counter() - t0, 2)})
        out.write(result.table() + "\n\n")
        out.flush()
    return {
        "version": REPORT_VERSION,
        "quick": options.quick,
        "started": started,
        "machine": where,
        "sections": results,
    }


def _main(args: argparse.Namespace) -> int:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with tempfile.TemporaryDirectory(prefix="p2pactor-bench-") as work:
        repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
        options = BenchOptions(quick=args.quick, repeats=repeats, work_dir=work)
        # With --json -, stdout holds the JSON document alone: the tables go to stderr.
        to_stdout = args.json == "-"
        report = run_bench(options, args.only, out=sys.stderr if to_stdout else sys.stdout)
    text = json.dumps(report, indent=2) + "\n"
    if to_stdout:
        sys.stdout.write(text)
        sys.stdout.flush()
    elif args.json:
        with open(args.json, "w") as f:
            f.write(text)
        sys.stderr.write(f"wrote {args.json}\n")
    failed = [s["name"] for s in report["sections"] if (s["skipped"] or "").startswith("failed")]
    if failed:
        sys.stderr.write(f"p2pactor bench: section(s) failed: {', '.join(failed)}\n")
        return 1
    return 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` to the command line's subcommands."""
    parser = commands.add_parser(
        "bench",
        help="measure p2pactor against raw NIXL, memcpy and vLLM's own P2P tier",
        description=(
            "Measure the data plane (vs raw NIXL and memcpy), the control plane, idle CPU "
            "and engine-thread cost (vs vLLM 0.33.0's P2P tier when vLLM is installed), "
            "fleets, hostile peers and floods, actor scale and replay, the source index, "
            "side by side in one run. Results are "
            "medians over repeats with [min..max]; see docs/benchmarks.md."
        ),
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run for CI (small sizes, few repeats)"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON to PATH; '-': to stdout, with the tables on stderr",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only these sections ({', '.join(SECTIONS)})",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats per measurement (default 5; quick 1)"
    )
    parser.set_defaults(handler=_main)
