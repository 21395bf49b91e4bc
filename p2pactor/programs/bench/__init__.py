"""``p2pactor bench``: side-by-side measurements a sceptical engineer can rerun.

Each section (:data:`~p2pactor.programs.bench.cli.SECTIONS`) is a module with ``TITLE``
and ``run(options) ->`` :class:`~p2pactor.programs.bench.cli.SectionResult`;
:mod:`p2pactor.programs.bench.cli` runs them in order, prints one table per section and
writes them all as JSON. Figures are medians over repeats with min and max, and ratios
(ours over a reference measured in the same run), because these machines are shared
and noisy. ``docs/benchmarks.md`` says what each section measures and has the latest runs.
"""
