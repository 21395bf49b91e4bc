"""Several "hosts" on one machine: network namespaces joined by a bridge, TCP between them.

Each host is a Linux network namespace with one veth interface (``eth0``) on a
private subnet (10.231.0.0/24 by default). The bridge joining them lives in a
namespace of its own, so nothing is added to the machine's own network: every
address exists only inside namespaces made here, and removing those namespaces
removes everything.

A network namespace alone does not stop UCX from taking its same-host
shortcuts (shared memory, CMA): it decides "same host" from the hostname and
reaches peers through ``/dev/shm``. So a command run on a host also gets its own
UTS namespace (the host's name as hostname) and mount namespace with a private
``/dev/shm``, and :meth:`Host.env` restricts UCX to TCP on the host's interface
(``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=eth0``). What goes between two hosts
then goes over TCP, through the kernel's network stack, as between machines.

Needs root and ``ip`` and ``unshare`` (iproute2, util-linux).
:func:`hosts_unavailable` says why not, where they are missing.

From the command line (``scripts/hosts`` runs this module)::

    scripts/hosts up 2                 # hosts h1 (10.231.0.1) and h2 (10.231.0.2)
    scripts/hosts exec h2 -- p2pactor serve --host 10.231.0.2 --preload 16
    scripts/hosts link h2 down         # cut h2's link; `up` restores it
    scripts/hosts down                 # kill what runs on them, remove them
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Final

import attrs

from p2pactor.errors import P2PActorError

DEFAULT_SUBNET: Final = "10.231.0"
"""The first three octets of the hosts' /24: host ``hN`` is ``10.231.0.N``."""

DEFAULT_PREFIX: Final = "p2pa"
"""Namespace names start with this (``p2pa-hub``, ``p2pa-h1``, ...)."""

DEVICE: Final = "eth0"
"""Each host's one interface."""

# Inside the new mount namespace: a private /dev/shm and the host's own name,
# then the command itself ("$0" "$@": no shell quoting of the user's argv).
_ENTER: Final = 'mount -t tmpfs -o size=1g tmpfs /dev/shm && hostname {name} && exec "$0" "$@"'


class HostsError(P2PActorError):
    """Hosts could not be made, reached or removed (the message says what to do)."""


def hosts_unavailable() -> str | None:
    """Why hosts cannot be made on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root; run as root (CI and these machines are)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    return None


@attrs.frozen
class Host:
    """One namespaced host: its name (also its hostname), namespace and address."""

    name: str
    netns: str
    address: str
    device: str = DEVICE

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host: its network, its hostname, its own ``/dev/shm``."""
        unshare = ["unshare", "--uts", "--mount", "sh", "-c", _ENTER.format(name=self.name)]
        return ["ip", "netns", "exec", self.netns, *unshare, *argv]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a node on this host: UCX over TCP on its interface only."""
        env = dict(os.environ if base is None else base)
        env.update(UCX_TLS="tcp,self", UCX_NET_DEVICES=self.device)
        return env

    def link(self, *, up: bool) -> None:
        """Bring this host's interface up or down (a cable plugged or pulled)."""
        _ip("-n", self.netns, "link", "set", self.device, "up" if up else "down")


def _ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS`` (iproute2 from PATH, with arguments this module builds); its stdout."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)  # noqa: S603, S607
    if check and done.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _nth_host(prefix: str, subnet: str, n: int) -> Host:
    """Host ``hN``: the one place its name, namespace and address are derived."""
    return Host(f"h{n}", f"{prefix}-h{n}", f"{subnet}.{n}")


def _namespaces(prefix: str) -> list[str]:
    lines = _ip("netns", "list", check=False).splitlines()  # "NAME (id: N)" a line
    return [w[0] for w in map(str.split, lines) if w and w[0].startswith(f"{prefix}-")]


def make_hosts(
    count: int, *, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET
) -> list[Host]:
    """Make ``count`` hosts ``h1``..``hN`` on one bridge; they stay until :func:`remove_hosts`.

    Raises:
        HostsError: This machine cannot make them (see :func:`hosts_unavailable`),
            a host of this prefix exists already, or an ``ip`` command failed
            (whatever was made is removed again).
    """
    reason = hosts_unavailable()
    if reason is not None:
        raise HostsError(f"cannot make hosts: {reason}")
    if not 1 <= count <= 250:
        raise HostsError(f"between 1 and 250 hosts, not {count}")
    if existing := _namespaces(prefix):
        raise HostsError(
            f"hosts with prefix {prefix!r} exist already ({', '.join(existing)}); "
            f"remove them first (`scripts/hosts down --prefix {prefix}`) or use another prefix"
        )
    hub = f"{prefix}-hub"
    hosts = [_nth_host(prefix, subnet, i) for i in range(1, count + 1)]
    try:
        _ip("netns", "add", hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, host in enumerate(hosts, 1):
            _ip("netns", "add", host.netns)
            # The host's end is made straight inside its namespace: every host's
            # interface is eth0, which could not coexist in the hub.
            peer = ("peer", "name", host.device, "netns", host.netns)
            _ip("-n", hub, "link", "add", f"v{i}", "type", "veth", *peer)
            _ip("-n", hub, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.device)
            _ip("-n", host.netns, "link", "set", host.device, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
    except BaseException:
        remove_hosts(prefix)
        raise
    return hosts


def remove_hosts(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Kill every process on the hosts of ``prefix`` and remove their namespaces.

    Returns:
        The namespaces removed. Removing a namespace removes its interfaces;
        its processes are killed first, since a namespace lives as long as one
        of them does.
    """
    removed = []
    for netns in _namespaces(prefix):
        for pid in map(int, _ip("netns", "pids", netns, check=False).split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _ip("netns", "delete", netns)
        removed.append(netns)
    return removed


@contextlib.contextmanager
def open_hosts(
    count: int, *, prefix: str | None = None, subnet: str = DEFAULT_SUBNET
) -> Iterator[list[Host]]:
    """Hosts for the length of a ``with`` block, removed on the way out however it ends.

    The default prefix names this process (``p2pa<pid>``), so concurrent test
    runs never share or remove each other's hosts.
    """
    prefix = f"{DEFAULT_PREFIX}{os.getpid()}" if prefix is None else prefix
    hosts = make_hosts(count, prefix=prefix, subnet=subnet)
    try:
        yield hosts
    finally:
        remove_hosts(prefix)


def _host(prefix: str, name: str, subnet: str) -> Host:
    number = name.removeprefix("h")
    if not (number.isdigit() and f"{prefix}-{name}" in _namespaces(prefix)):
        raise HostsError(
            f"no host {name!r} with prefix {prefix!r}; make it with `scripts/hosts up`"
        )
    return _nth_host(prefix, subnet, int(number))


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/hosts``: make, use and remove namespaced hosts by hand."""
    parser = argparse.ArgumentParser(prog="scripts/hosts", description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix")
    parser.add_argument("--subnet", default=DEFAULT_SUBNET, help="first three octets of the /24")
    sub = parser.add_subparsers(dest="what", required=True)
    up = sub.add_parser("up", help="make N hosts h1..hN")
    up.add_argument("count", type=int)
    sub.add_parser("down", help="kill what runs on the hosts and remove them")
    run = sub.add_parser("exec", help="run a command on a host (UCX over TCP only)")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    link = sub.add_parser("link", help="bring a host's link up or down")
    link.add_argument("host")
    link.add_argument("state", choices=("up", "down"))
    args = parser.parse_args(argv)
    try:
        if args.what == "up":
            for host in make_hosts(args.count, prefix=args.prefix, subnet=args.subnet):
                sys.stdout.write(f"{host.name} {host.address} (netns {host.netns})\n")
        elif args.what == "down":
            sys.stdout.write(f"removed {len(remove_hosts(args.prefix))} namespaces\n")
        elif args.what == "link":
            _host(args.prefix, args.host, args.subnet).link(up=args.state == "up")
        else:
            command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not command:
                parser.error("exec needs a command after the host")
            host = _host(args.prefix, args.host, args.subnet)
            return subprocess.call(host.command(command), env=host.env())  # noqa: S603
    except HostsError as exc:
        sys.stderr.write(f"scripts/hosts: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
