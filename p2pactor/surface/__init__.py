"""The operator surface: metrics, ``/status``, the live timeline and dashboard.

Everything here attaches to a running node from outside, reading a
:class:`p2pactor.runtime.node.Node` and following its event streams
(:func:`p2pactor.surface.attach.open_operator_surface`);
the runtime never imports it. Import from :mod:`p2pactor`; these modules are internal.
"""
