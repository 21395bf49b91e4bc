"""What an operator installs: the wheel and sdist hold every package and file,
the installed wheel runs the demo, and the requirements leave room for vLLM's.

vLLM pins its own torch (0.33.0: ``torch==2.14.0``); a library that pins
another cannot be installed next to it. The requirements check reads vLLM's
metadata (``scripts/setup`` installs vLLM with ``--no-deps``, so its metadata is
there even though its requirements are not) and fails on any distribution both
require whose versions cannot agree.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DASHBOARD = ROOT / "p2pactor" / "surface" / "dashboard"


def test_every_package_is_listed_in_pyproject() -> None:
    config = PYPROJECT["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "p2pactor").rglob("__init__.py")
    } | {"p2pactor.adapters"}
    assert found == listed
    assert config["package-dir"]["p2pactor.adapters"] == "adapters"


# -- requirements against vLLM's ---------------------------------------------


def _vllm_version_in_setup() -> str:
    match = re.search(r'"vllm==([^"]+)"', (ROOT / "scripts" / "setup").read_text())
    assert match, "scripts/setup no longer installs a pinned vLLM"
    return match.group(1)


def _vllm_requirements() -> list[Requirement]:
    wanted = _vllm_version_in_setup()
    try:
        installed = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"vLLM {wanted} is not installed: run scripts/setup")
    assert installed == wanted, f"vLLM {installed} is installed; scripts/setup installs {wanted}"
    return [Requirement(line) for line in importlib.metadata.requires("vllm") or []]


def _ours(group: str) -> list[Requirement]:
    project = PYPROJECT["project"]
    lines = (
        project["dependencies"]
        if group == "dependencies"
        else project["optional-dependencies"][group]
    )
    return [Requirement(line) for line in lines]


def _pins(spec: SpecifierSet) -> list[str]:
    return [s.version for s in spec if s.operator in {"==", "==="} and "*" not in s.version]


def _candidates(name: str, *specs: SpecifierSet) -> set[str]:
    """Concrete versions to try both ranges on: the installed one and every bound."""
    found = {s.version for spec in specs for s in spec if s.operator in {">=", "==", "~=", "==="}}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        found.add(importlib.metadata.version(name))
    valid = set()
    for version in found:
        try:
            Version(version.removesuffix(".*"))
        except InvalidVersion:
            continue
        valid.add(version.removesuffix(".*"))
    return valid


def conflicts(
    ours: Iterable[Requirement], theirs: Iterable[Requirement]
) -> dict[NormalizedName, str]:
    """Every distribution both require whose versions cannot agree, with why.

    A version ``theirs`` pins (``==``) must satisfy our specifier; where both give
    ranges, some concrete version (installed, or either side's bound) must satisfy
    both. Their requirements for extras are not theirs to impose: skipped.
    """
    mine: dict[NormalizedName, list[Requirement]] = {}
    for req in ours:
        mine.setdefault(canonicalize_name(req.name), []).append(req)
    found: dict[NormalizedName, str] = {}
    for req in theirs:
        if req.marker is not None and "extra" in str(req.marker):
            continue
        name = canonicalize_name(req.name)
        for own in mine.get(name, []):
            pins = _pins(req.specifier)
            if pins:
                bad = [p for p in pins if not own.specifier.contains(p, prereleases=True)]
                if bad:
                    found[name] = f"they pin {req}, we require {own}"
            elif not any(
                req.specifier.contains(v, prereleases=True)
                and own.specifier.contains(v, prereleases=True)
                for v in _candidates(name, req.specifier, own.specifier)
            ):
                found[name] = f"no version tried satisfies both {req} and {own}"
    return found


@pytest.mark.parametrize("group", ["dependencies", "vllm"])
def test_our_requirements_leave_room_for_vllms(group: str) -> None:
    theirs = _vllm_requirements()
    ours = _ours(group)
    assert conflicts(ours, theirs) == {}
    if group == "dependencies":
        # the check saw the distributions that caused trouble before
        shared = {canonicalize_name(r.name) for r in ours} & {
            canonicalize_name(r.name) for r in theirs
        }
        assert {"torch", "pyzmq", "msgspec", "prometheus-client"} <= shared


def test_the_checker_catches_a_pin_a_range_and_a_differently_spelt_name() -> None:
    theirs = _vllm_requirements()
    assert set(conflicts([Requirement("torch==2.13.0")], theirs)) == {"torch"}
    assert set(conflicts([Requirement("pyzmq<25")], theirs)) == {"pyzmq"}
    assert set(conflicts([Requirement("Prometheus_Client<0.18")], theirs)) == {"prometheus-client"}
    # what vLLM requires only for an extra is not a conflict
    assert conflicts([Requirement("pandas<0")], theirs) == {}
    assert conflicts([Requirement("torch>=2.4"), Requirement("trio<0")], theirs) == {}


# -- the wheel and sdist, installed as an operator would ---------------------


def _run(cwd: Path, env: dict[str, str], *args: str | Path) -> str:
    run = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, f"{args}\n{run.stdout}\n{run.stderr}"
    return run.stdout


def _source_copy(dest: Path) -> None:
    """What the sdist is built from: pyproject, README and the two package folders.

    A copy, so a build never writes into (or races another build in) the checkout.
    """
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("p2pactor", "adapters"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)


def _dashboard_files() -> set[str]:
    files = {p.name for p in DASHBOARD.glob("*.html")}
    files |= {f"static/{p.name}" for p in (DASHBOARD / "static").iterdir() if p.is_file()}
    assert "index.html" in files
    return files


def test_the_built_wheel_installs_in_a_fresh_venv_and_runs_the_demo(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env |= {"NIXL_LOG_LEVEL": "WARN", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    _source_copy(src)

    # The sdist, with setuptools' PEP 517 hook (offline: no isolated build env).
    hook = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    _run(src, env, sys.executable, "-c", hook, dist)
    (sdist,) = dist.glob("p2pactor-*.tar.gz")
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"pyproject.toml", "adapters/vllm.py", "adapters/nixl.py"} <= in_sdist
    assert {f"p2pactor/surface/dashboard/{f}" for f in _dashboard_files()} <= in_sdist

    # The wheel, built from the sdist: so the sdist holds all a build needs.
    pip_wheel = ["pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, sdist]
    _run(tmp_path, env, sys.executable, "-m", *pip_wheel)
    (wheel,) = dist.glob("p2pactor-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
        (metadata,) = (n for n in in_wheel if n.endswith(".dist-info/METADATA"))
        headers = whl.read(metadata).decode().splitlines()
    assert {"p2pactor/adapters/vllm.py", "p2pactor/py.typed"} <= in_wheel
    assert {f"p2pactor/surface/dashboard/{f}" for f in _dashboard_files()} <= in_wheel
    assert not any(name.startswith("adapters/") for name in in_wheel)  # never top-level
    field = "Requires-Dist: "
    requires = [Requirement(h.removeprefix(field)) for h in headers if h.startswith(field)]
    declared = {str(Requirement(line)) for line in PYPROJECT["project"]["dependencies"]}
    assert {str(r) for r in requires if r.marker is None} == declared

    # A fresh venv gets the wheel alone; the dependencies come from this venv
    # through a .pth line, which goes on sys.path after the venv's own site-packages.
    # Our pip installs into it (--python): a copy of pip of its own (ensurepip)
    # would cost seconds and is no part of what is checked.
    venv = tmp_path / "venv"
    _run(tmp_path, env, sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    install = ["install", "-q", "--no-deps", "--no-index", wheel]
    _run(tmp_path, env, sys.executable, "-m", "pip", "--python", python, *install)
    site = _run(
        tmp_path, env, python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"
    )
    deps = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    (Path(site.strip()) / "zz_p2pactor_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    where = _run(tmp_path, env, python, "-c", "import p2pactor; print(p2pactor.__file__)")
    assert Path(where.strip()).is_relative_to(site.strip()), where

    # From outside the checkout, so the source tree cannot be imported.
    cli = venv / "bin" / "p2pactor"
    version = _run(tmp_path, env, cli, "--version")
    assert version.strip() == f"p2pactor {PYPROJECT['project']['version']}"
    demo = ["demo", "--nodes", "2", "--requests", "2", "--block-size", "4096", "--timeout", "90"]
    out = _run(tmp_path, env, cli, *demo, "--log-dir", tmp_path / "logs")
    assert "Demo OK: every fetched byte verified" in out
