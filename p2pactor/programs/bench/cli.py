"""``p2pactor bench [--quick] [--json PATH] [--only SECTION ...]``, and what a section reports.

A section reports a :class:`SectionResult`: statistics over repeats (:class:`Stat`), rows,
ratios, notes. The JSON written by ``p2pactor bench --json`` is :func:`run_bench`'s:
``{"version", "machine", "quick", "started", "sections": [...]}``, each section
``{"name", "title", "skipped", "rows", "ratios", "notes", "seconds"}``; a row
is a flat object of numbers and strings (statistics as
``{"median", "min", "max", "n"}``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

REPORT_VERSION = 1


@attrs.frozen(kw_only=True)
class Stat:
    """A median over repeats, with the spread (min, max) and the count."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stat:
        """The statistics of ``values`` (at least one)."""
        xs = sorted(values)
        return cls(median=statistics.median(xs), min=xs[0], max=xs[-1], n=len(xs))

    def text(self, digits: int = 2) -> str:
        """``median [min..max]``, for tables."""
        if self.n == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.min:.{digits}f}..{self.max:.{digits}f}]"


Cell = str | int | float | Stat | None


def ratio(ours: Iterable[float], theirs: Iterable[float]) -> Stat | None:
    """Ours over the reference, repeat by repeat (a reference of 0 left out); None if none."""
    xs = [a / b for a, b in zip(ours, theirs, strict=True) if b]
    return Stat.of(xs) if xs and all(math.isfinite(x) for x in xs) else None


@attrs.frozen(kw_only=True)
class BenchOptions:
    """How a section should run.

    Attributes:
        quick: A smoke run for CI: small sizes, one or two repeats; it must
            finish in about a minute per section and still produce every key.
        repeats: Repeats for the statistics (sections may use fewer in quick mode).
        work_dir: A scratch directory the section may use (logs, sockets).
    """

    quick: bool = False
    repeats: int = 5
    work_dir: str = "."


@attrs.frozen(kw_only=True)
class SectionResult:
    """One section's results.

    Attributes:
        name: The section's short name (``dataplane``; :func:`run_bench` sets it).
        title: One line saying what was measured (the section's ``TITLE``, set likewise).
        rows: The table, one mapping per row, same keys in every row.
        ratios: Headline ratios (ours over reference), by a readable name.
        notes: Sentences printed under the table (targets met or missed, skips).
        skipped: Why the whole section did not run (e.g. vLLM not installed), or None.
    """

    name: str = ""
    title: str = ""
    rows: Sequence[Mapping[str, Cell]] = ()
    ratios: Mapping[str, Stat] = attrs.field(factory=dict)
    notes: Sequence[str] = ()
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this section (``p2pactor bench`` adds ``seconds``, its time)."""
        return attrs.asdict(self, recurse=False) | {
            "rows": [
                {k: attrs.asdict(v) if isinstance(v, Stat) else v for k, v in row.items()}
                for row in self.rows
            ],
            "ratios": {k: attrs.asdict(v) for k, v in self.ratios.items()},
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """The section as text: title, aligned table, ratios, notes."""
        lines = [f"== {self.name}: {self.title}"]
        if self.skipped:
            lines.append(f"   skipped: {self.skipped}")
        if self.rows:
            keys = list(self.rows[0])
            cells = [[_cell_text(row.get(k)) for k in keys] for row in self.rows]
            widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
            lines.append("   " + "  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
            lines.append("   " + "  ".join("-" * w for w in widths))
            lines.extend(
                "   " + "  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)) for c in cells
            )
        for name, stat in self.ratios.items():
            lines.append(f"   ratio {name}: {stat.text()}")
        lines.extend(f"   note: {n}" for n in self.notes)
        return "\n".join(lines)


def _cell_text(value: Cell) -> str:
    if value is None:
        return "-"
    if isinstance(value, Stat):
        return value.text()
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    with open("/proc/cpuinfo") as f:
        models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return {
        "cpu": models[0] if models else platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_1min_at_start": os.getloadavg()[0],
    }


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
            result = SectionResult(skipped=f"failed: {type(exc).__name__}: {exc}")
        result = attrs.evolve(result, name=name, title=section.TITLE)
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
            "Measure the data plane (vs raw NIXL and memcpy), the control plane and "
            "engine-thread cost (vs vLLM 0.33.0's P2P tier when vLLM is installed), fleets, "
            "hostile peers and floods, actor scale and replay, the source index, side by side "
            "in one run. Results are medians over repeats with [min..max]; see docs/benchmarks.md."
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
