"""Engine-thread cost of a P2P secondary tier: p2pactor's vLLM adapter against vLLM's own tier.

A thin wrapper: the measurement lives in the package, in
:mod:`p2pactor.programs.bench._vllm_engine` (read its docstring for the setup, the
scripted engine and what is measured), and ``p2pactor bench --only engine``
reports its headline figures. This script prints every figure, as before:

``.venv/bin/python benchmarks/vllm_engine_thread.py`` (``--requests N``,
``--repeats R``, ``--json PATH``; ``--help`` for the rest). About two minutes
at the defaults on two cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script from the repository root: make p2pactor importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pactor.programs.bench._vllm_launch import main

if __name__ == "__main__":
    sys.exit(main())
