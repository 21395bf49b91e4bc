"""Every package in the source tree ships in the wheel (pyproject lists them by hand)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "p2pactor").rglob("__init__.py")
    } | {"p2pactor.adapters"}
    assert found == listed
    assert config["package-dir"]["p2pactor.adapters"] == "adapters"
