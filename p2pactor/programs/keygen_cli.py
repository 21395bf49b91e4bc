"""``p2pactor keygen``: make a node's CURVE key pair for an authenticated control channel.

``p2pactor keygen STEM --address HOST:PORT`` writes two files (see
:mod:`p2pactor.runtime.keys` and ``docs/security.md``):

* ``STEM.key``, the public certificate: give it to every peer that should
  trust this node (they copy it into their trusted directory);
* ``STEM.key_secret``, the secret certificate, mode 0600: it stays on this
  node (``--curve-secret-key``).

``--address`` is the node id the key speaks for, exactly as the node is
configured (``--host`` and ``--port``); repeat it (or give a comma-separated
list) when one key serves several nodes, say the data-parallel ranks of one
engine. Peers refuse a connection whose claimed address is not bound to the
key that authenticated it.

Exit status: 0 when both files were written; 2 when nothing was (a file
exists and ``--force`` was not given, a bad address, a folder that cannot be
written).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Final

from p2pactor.adapters.zmq import generate_keypair
from p2pactor.errors import ConfigError
from p2pactor.runtime.keys import load_public, parse_addresses

__all__ = ["register", "run"]

_PROG: Final = "p2pactor keygen"


def register(commands: Any) -> None:
    """Add ``keygen`` to the command line's subcommands."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "keygen",
        help="make a CURVE key pair for an authenticated, encrypted control channel",
        description=(
            "Make a ZeroMQ CURVE key pair for one node: STEM.key (public: give it to the "
            "peers that should trust this node) and STEM.key_secret (secret, mode 0600: "
            "keep it on this node). See docs/security.md."
        ),
    )
    parser.add_argument(
        "stem",
        metavar="STEM",
        help="path of the files without suffix, e.g. /etc/p2pactor/runtime/node-a",
    )
    parser.add_argument(
        "--address",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help=(
            "the node id the key speaks for, exactly as the node is configured (--host "
            "and --port); repeat it, or give a comma-separated list, for several nodes "
            "sharing one key (say the data-parallel ranks of one engine)"
        ),
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace existing files (peers that trust the old key must get the new .key)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Write the key pair and say what to do with each file; the exit status."""
    try:
        addresses = sorted(parse_addresses(",".join(args.address), where="--address"))
        stem = _stem(args.stem)
        public_path, secret_path = generate_keypair(stem, addresses, force=args.force)
        public_key, _ = load_public(public_path)
    except ConfigError as exc:
        sys.stderr.write(f"{_PROG}: {exc}\n")
        return 2
    host, _, port = addresses[0].rpartition(":")
    out = sys.stdout
    out.write(
        f"Wrote a CURVE key pair for {', '.join(addresses)}:\n"
        f"  {public_path}  public: give it to every peer that should trust this node\n"
        f"  {secret_path}  SECRET (mode 0600): keep it on this node, never share it\n"
        f"Public key: {public_key}\n"
        "\n"
        "Next:\n"
        f"  1. On every peer, copy {public_path.name} into its trusted directory "
        "(its --curve-trusted DIR) and restart it.\n"
        "  2. Put the peers' .key files into this node's trusted directory, then start it:\n"
        f"       p2pactor serve --host {shlex.quote(host)} --port {port} "
        f"--curve-secret-key {shlex.quote(os.fspath(secret_path))} --curve-trusted DIR\n"
        "     (or set P2PACTOR_CURVE_SECRET_KEY and P2PACTOR_CURVE_TRUSTED; in vLLM, the tier "
        "options curve_secret_key and curve_trusted).\n"
    )
    out.flush()
    return 0


def _stem(text: str) -> Path:
    stem = Path(text)
    if stem.name.endswith((".key", ".key_secret")):
        raise ConfigError(
            f"give STEM without a suffix (not {text!r}): keygen adds .key and .key_secret"
        )
    if not stem.parent.is_dir():
        raise ConfigError(
            f"the folder {stem.parent} does not exist: create it first "
            "(the secret key should live in a folder only this node's user can read)"
        )
    return stem
