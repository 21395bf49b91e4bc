"""The trio runtime: actors, sessions, the node, the event log.

It drives the pure core (:mod:`p2pactor.core`) with real time and real I/O
through the transports' small Protocols (:mod:`p2pactor.runtime.transport`).
It never imports the operator surface (:mod:`p2pactor.surface`), which attaches
to a node from outside. Import from :mod:`p2pactor`; these modules are internal.
"""
