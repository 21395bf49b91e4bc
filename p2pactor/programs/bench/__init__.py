"""``p2pactor bench``: side-by-side measurements a sceptical engineer can rerun.

Each section is a module with ``NAME``, ``TITLE`` and ``run(options) ->``
:class:`~p2pactor.programs.bench.report.SectionResult`; :mod:`p2pactor.programs.bench.cli` runs
them in order and prints one table per section, and writes them all as JSON.
Everything is measured in one run on one machine and reported as medians over
repeats with min and max, and as ratios (ours over a reference measured in
the same run), because these machines are shared and noisy.

Sections (``docs/benchmarks.md`` has the latest full run):

* ``dataplane``: fetch B x S bytes end to end vs raw NIXL vs memcpy;
* ``control``: lookup throughput and latency vs vLLM 0.33.0's own P2P sessions;
* ``engine``: the vLLM adapter's engine-thread cost vs vLLM's tier;
* ``scale``: 10,000 concurrent requests on one node, and replay speed;
* ``peers``: 16 nodes as processes on loopback, each fetching from the others;
* ``flood``: an honest peer's lookup latency while a hostile peer floods the
  producer, ours and vLLM's tier as the producer;
* ``idle``: the CPU of an idle node with one peer connected, ours vs vLLM's tier;
* ``hosts``: the ``dataplane`` fetch across two namespaced hosts over UCX TCP vs
  raw NIXL over the same path, and lookup latency across hosts vs loopback
  (skipped without root).
"""
