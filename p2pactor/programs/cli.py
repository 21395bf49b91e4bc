"""The ``p2pactor`` command line.

Subcommands arrive with the features they drive (``demo``, ``serve``,
``replay``, ``bench``); the parser is built so each can register itself.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import TYPE_CHECKING

from p2pactor import __version__
from p2pactor.errors import ConfigError
from p2pactor.programs import keygen_cli, replay_cli, serve, status_cli
from p2pactor.programs.bench import cli as bench_cli
from p2pactor.programs.demo import cli as demo_cli
from p2pactor.surface import logsetup

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["build_parser", "main"]

# Commands that run nodes or long work take the logging flags after their name too.
_LOGGING_COMMANDS = ("demo", "serve", "replay", "bench")
# bench opens hundreds of sessions: a line for each would bury its tables.
_DEFAULT_LEVELS = {"bench": "WARNING"}


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of the ``p2pactor`` command."""
    parser = argparse.ArgumentParser(
        prog="p2pactor",
        # Never guess: "serve --log FILE" must not read as an abbreviation of
        # the top-level --log-format/--log-level.
        allow_abbrev=False,
        description=(
            "Peer-to-peer KV-cache sharing for LLM inference engines. "
            "Nodes look up, fetch and serve KV blocks over ZeroMQ and NIXL."
        ),
    )
    parser.add_argument("--version", action="version", version=f"p2pactor {__version__}")
    logsetup.add_logging_arguments(parser, default=None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_cli.register(commands)
    serve.register(commands)
    replay_cli.register(commands)
    keygen_cli.register(commands)
    status_cli.register(commands)
    bench_cli.register(commands)
    for name in _LOGGING_COMMANDS:
        logsetup.add_logging_arguments(commands.choices[name])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    # Each subcommand's register() sets the function that runs it.
    handler: Callable[[argparse.Namespace], int] = args.handler
    with contextlib.ExitStack() as scope:
        try:  # diagnostics go to stderr, never stdout
            level = _DEFAULT_LEVELS.get(args.command, "INFO")
            scope.enter_context(logsetup.command_logging(args, default_level=level))
        except ConfigError as exc:
            sys.stderr.write(f"p2pactor: {exc}\n")
            return 2
        try:
            return handler(args)
        except Exception:
            # Through logging, so that with --log-format json the traceback is a JSON line too.
            logging.getLogger("p2pactor.cli").critical(
                "p2pactor %s stopped on an unexpected error; if the traceback does not point "
                "at a cause of your own (a file, a port, a setting), please report it with it",
                args.command,
                exc_info=True,
            )
            return 1
