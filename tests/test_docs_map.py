"""docs/design.md opens with the map of the library, derived from the modules' docstrings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_design_docs_map_is_the_modules_own_summaries() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "map"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
