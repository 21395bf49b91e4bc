"""The ``p2pactor`` command line: ``--help``, ``--version``, bare invocation."""

from __future__ import annotations

import subprocess
import sys

import pytest

import p2pactor
from p2pactor.programs.cli import main


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"p2pactor {p2pactor.__version__}"


def test_help_describes_the_tool(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: p2pactor")
    assert "KV-cache sharing" in out


def test_no_command_prints_usage_to_stderr_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: p2pactor" in captured.err


def test_module_entry_point_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "p2pactor", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"p2pactor {p2pactor.__version__}"


def test_a_subcommand_option_is_never_read_as_an_abbreviated_global_one() -> None:
    # serve's --log (the event log) against the top-level --log-format/--log-level.
    from p2pactor.programs.cli import build_parser  # noqa: PLC0415

    args = build_parser().parse_args(["serve", "--log", "node.p2plog"])
    assert args.log == "node.p2plog"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-f", "json", "serve"])  # no guessing at the top either


def test_serve_refuses_an_ephemeral_control_port(capsys: pytest.CaptureFixture[str]) -> None:
    # The node's id is HOST:PORT and peers dial it: HOST:0 could never be reached.
    assert main(["serve", "--host", "127.0.0.1", "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "give --port" in captured.err
