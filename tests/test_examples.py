"""The examples a new user copies from still run and still say what they claim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_core_walkthrough_moves_bytes_and_replays() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "core_walkthrough.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    lines = out.stdout.splitlines()
    assert lines[-1] == "bytes equal; replaying both logs gives the live states"
    assert "engine   answers ['hit', 'hit', 'hit', 'miss']" in out.stdout
    assert "engine   load 1 ok=True" in out.stdout
    assert any(line.endswith("Finished") for line in lines)


def test_two_nodes_share_blocks_both_ways() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "two_nodes.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "a pulled 8 blocks from b; b pulled 8 blocks from a"
    assert "a:5710  c:b:5710:a-req  -> done" in lines
    assert "b:5710  p:a:5710:a-req  -> closed" in lines
    assert lines[-1] == "bytes equal on both sides"


def test_serve_and_fetch_over_real_transports() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serve_and_fetch.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    lines = [line for line in out.stdout.splitlines() if not line.startswith("20")]
    assert lines[-2].endswith("holds 16 of the 18 blocks asked for")
    assert lines[-1] == "fetched 16 blocks (1024 KiB), all verified"
