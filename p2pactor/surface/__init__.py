"""The operator surface: metrics, ``/status``, the live timeline and dashboard.

Everything here attaches to a running node from outside, through the read-only
:class:`p2pactor.runtime.view.NodeView` (:func:`p2pactor.surface.attach.open_operator_surface`);
the runtime never imports it. Import from :mod:`p2pactor`; these modules are internal.
"""
