"""``p2pactor bench``: side-by-side measurements a sceptical engineer can rerun.

Each section (:data:`~p2pactor.programs.bench.cli.SECTIONS`) is a module with ``TITLE``
and ``run(options) ->`` :class:`~p2pactor.programs.bench.cli.SectionResult`, run by
:mod:`p2pactor.programs.bench.cli`; ``docs/benchmarks.md`` says what each measures.
"""
