"""``p2pactor demo``: nodes as separate processes sharing KV blocks on loopback.

:mod:`~p2pactor.programs.demo.workload` is the pure workload every process agrees on,
:mod:`~p2pactor.programs.demo.node` one node's process, :mod:`~p2pactor.programs.demo.run` the
orchestrator that starts them and shows progress, :mod:`~p2pactor.programs.demo.summary` the
summary it prints.
"""
