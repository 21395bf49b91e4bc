"""The producer of ``benchmarks/vllm_engine_thread.py``.

Now :mod:`p2pactor.programs.bench._vllm_tier`.

Kept as a thin wrapper so older command lines still work:
``python benchmarks/_vllm_producer.py --tier ours|vllm --port N ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script from the repository root: make p2pactor importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pactor.programs.bench._vllm_tier import *  # noqa: F403 - the old module's names
from p2pactor.programs.bench._vllm_tier import main

if __name__ == "__main__":
    sys.exit(main())
