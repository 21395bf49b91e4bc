"""CURVE key files: make them, read them, and the ring of peers we trust.

A node that authenticates its control channel has a key pair in two files,
written by ``p2pactor keygen STEM --address HOST:PORT``:

* ``STEM.key``: the public certificate. Hand it to every peer that should
  trust this node; they put it in their trusted directory.
* ``STEM.key_secret``: the secret certificate, mode 0600, never leaves the node.

Both are ZeroMQ certificates in ZPL, the text format of czmq's ``zcert``: a
``metadata`` section with the ``address``, and a ``curve`` section with the
``public-key`` (and the ``secret-key``, in the secret file only). The ``address`` is what the key
speaks for: the node ids (``host:port``, comma-separated when one key serves
several nodes, say the data-parallel ranks of one engine) whose connections
this key may authenticate. A peer claiming an address bound to another key is
refused, so a trusted peer cannot pose as another.

Of ZPL only what certificates use is read: sections at the root, ``name =
value`` one level down (4 spaces), comments and blank lines. Plain file
handling, no pyzmq (making a key and checking a pair take libzmq:
``p2pactor.adapters._zmq_curve``); every problem is a
:class:`~p2pactor.errors.ConfigError` that says what to do.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final

import attrs

from p2pactor.errors import ConfigError
from p2pactor.runtime.addresses import node_id_port, peer_ids

PUBLIC_SUFFIX: Final = ".key"
"""File name suffix of a public certificate (what peers trust)."""

SECRET_SUFFIX: Final = ".key_secret"  # noqa: S105 - a file suffix, not a secret
"""File name suffix of a secret certificate (what a node keeps)."""

KEYGEN_HINT: Final = "p2pactor keygen STEM --address HOST:PORT"
"""How to make a key pair, for messages that say what to do."""

_Z85_KEY: Final = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")  # 32 bytes in Z85
# A ZPL line a certificate uses: 4 spaces a level, a name, maybe "= value"
# (quoted: "#" inside is text, Z85 uses it; or bare), maybe a comment.
_ZPL_LINE: Final = re.compile(
    r"(?P<indent> *)(?P<name>[A-Za-z0-9$\-_@.&+/]+)\s*(?:(?P<eq>=)\s*"
    r"(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)'|(?P<bare>[^#\"'\s][^#]*?)?)\s*)?(?:#.*)?"
)


def parse_addresses(value: str | Iterable[str], where: str = "address") -> frozenset[str]:
    """The node ids in ``value``: one ``host:port``, a comma-separated list, or a collection.

    Raises:
        ConfigError: One is not ``host:port`` (``where`` names the source), or
            there are none.
    """
    addresses = peer_ids(value)
    if not addresses:
        raise ConfigError(f"{where}: no address given: give the node's host:port")
    if bad := sorted(a for a in addresses if not node_id_port(a)):
        raise ConfigError(
            f"{where}: {bad[0]!r} is not a node id: give host:port with a port from 1 to "
            "65535, the host exactly as the node is configured (its --host)"
        )
    return addresses


def _parse_zpl(text: str, path: Path) -> dict[str, dict[str, str]]:
    """The two levels of a certificate: ``{section: {name: value}}``; deeper ones are ignored."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip(" ").startswith("#"):
            continue
        match = _ZPL_LINE.fullmatch(line.rstrip())
        if match is None or len(match["indent"]) % 4:
            raise ConfigError(
                f"{path}, line {number}: not ZPL as a certificate has it (a name, maybe "
                '= "value", indented by 4 spaces a level)'
            )
        depth = len(match["indent"]) // 4
        name = match["name"]
        if depth == 0:  # a section; a value at the root (no certificate has one) is ignored
            current = None if match["eq"] else sections.setdefault(name, {})
        elif depth == 1 and current is not None:
            current[name] = "".join(filter(None, match.group("dq", "sq", "bare")))
    return sections


def _check_key(value: str | None, what: str, path: Path) -> str:
    if value is None:
        raise ConfigError(
            f"{path} has no {what}: it is not a ZeroMQ CURVE certificate; "
            f"make a key pair with `{KEYGEN_HINT}`"
        )
    if not _Z85_KEY.fullmatch(value):
        raise ConfigError(
            f"{path}: its {what} is not a 40-character Z85 CURVE key (the file is damaged); "
            f"make a new key pair with `{KEYGEN_HINT}`"
        )
    return value


@attrs.frozen(kw_only=True)
class CurveKeypair:
    """This node's CURVE key pair, from its secret certificate.

    Attributes:
        public_key: The public key, Z85 text (40 characters).
        secret_key: The secret key, Z85 text; never printed.
        addresses: The node ids the key speaks for (``host:port``).
        path: The file it was read from; None if made in memory.
    """

    public_key: str
    secret_key: str = attrs.field(repr=False)
    addresses: frozenset[str]
    path: str | None = None

    def public_path(self) -> str | None:
        """The public certificate keygen wrote beside :attr:`path`, for messages."""
        if self.path is None or not self.path.endswith(SECRET_SUFFIX):
            return None
        return self.path[: -len(SECRET_SUFFIX)] + PUBLIC_SUFFIX


def _load(path: str | os.PathLike[str], *, secret: bool) -> CurveKeypair:
    """A certificate, refused as a secret or a public file (a public one's secret_key is "").

    A secret certificate others can read is a key anyone on the host may have
    copied; a "public" one holding a secret key must never have been shared.
    """
    file = Path(path)
    what = f"CURVE {'secret' if secret else 'public'} key file"
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {file} does not exist: make one with `{KEYGEN_HINT}`") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {file} is a directory, not a certificate file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file} is not a text certificate: give the file keygen wrote") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {file}: {exc.strerror or exc}") from None
    sections = _parse_zpl(text, file)
    curve = sections.get("curve", {})
    mode = stat.S_IMODE(file.stat().st_mode) if secret and os.name == "posix" else 0
    if mode & 0o077:
        raise ConfigError(
            f"{file} is open to other users (mode {mode:04o}): a secret key must be "
            f"readable by its owner only; run `chmod 600 {file}` (in Kubernetes, mount "
            "the secret with defaultMode 0400), and make a new key pair if others may "
            "have read it"
        )
    if not secret and "secret-key" in curve:
        raise ConfigError(
            f"{file} holds a SECRET key, which must never leave its node: put only the peer's "
            f"public {PUBLIC_SUFFIX} file here, delete this copy, and have that peer make a "
            f"new key pair (`{KEYGEN_HINT}`), as this one has been exposed"
        )
    public = _check_key(curve.get("public-key"), "public-key", file)
    if secret and "secret-key" not in curve:
        raise ConfigError(
            f"{file} is a public certificate, not a secret one: give the node its "
            f"{SECRET_SUFFIX} file (keygen writes both)"
        )
    # Whether the public key belongs to the secret one takes libzmq: the zmq
    # transport checks it when it sets up CURVE.
    secret_key = _check_key(curve["secret-key"], "secret-key", file) if secret else ""
    if not (address := sections.get("metadata", {}).get("address")):
        raise ConfigError(
            f"{file} has no address metadata (the host:port the key speaks for), so it "
            f"cannot bind a peer's identity: regenerate it with `{KEYGEN_HINT}`"
        )
    addresses = parse_addresses(address, where=f"{file}, metadata address")
    return CurveKeypair(
        public_key=public, secret_key=secret_key, addresses=addresses, path=str(file)
    )


def load_secret(path: str | os.PathLike[str]) -> CurveKeypair:
    """This node's key pair, from its secret certificate (``*.key_secret``).

    The file must be readable by its owner only (``chmod 600``), as SSH insists
    for private keys: a secret others can read is refused rather than trusted.

    Raises:
        ConfigError: The file is missing, unreadable, readable by others, not
            a secret certificate, damaged, or has no address metadata.
    """
    return _load(path, secret=True)


def load_public(path: str | os.PathLike[str]) -> tuple[str, frozenset[str]]:
    """The public key and the addresses it speaks for, from a ``*.key`` certificate.

    Raises:
        ConfigError: The file is missing, not a certificate, damaged, has no
            address metadata, or holds a secret key (which must never be shared).
    """
    pair = _load(path, secret=False)
    return pair.public_key, pair.addresses


def write_keypair(
    path_stem: str | os.PathLike[str],
    address: str | Iterable[str],
    public: str,
    secret: str,
    *,
    force: bool = False,
) -> tuple[Path, Path]:
    """Write a new key pair (Z85 keys) to ``<stem>.key`` and ``<stem>.key_secret``.

    The key pair comes from libzmq, which only the zmq adapter imports: call
    :func:`p2pactor.adapters.zmq.generate_keypair`, which makes it.

    Raises:
        ConfigError: A file exists (and not ``force``), an address is not
            ``host:port``, or the files cannot be written.
    """
    addresses = parse_addresses(address, where="--address")
    paths = Path(os.fspath(path_stem) + PUBLIC_SUFFIX), Path(os.fspath(path_stem) + SECRET_SUFFIX)
    if not force and (existing := [str(p) for p in paths if p.exists() or p.is_symlink()]):
        raise ConfigError(
            f"{' and '.join(existing)} already exist: pick another name, or pass --force "
            "to replace the key pair (peers that trust the old key must get the new .key)"
        )
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    # ZPL has no escapes: a value holds any character but its quotes. Ours hold
    # neither '"' nor a newline: Z85 keys, and checked addresses.
    body = ["metadata", f'    address = "{",".join(sorted(addresses))}"', "curve"]
    body.append(f'    public-key = "{public}"')
    secret_head = [
        "ZeroMQ CURVE **Secret** Certificate",
        "DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.",
    ]
    public_head = [
        "ZeroMQ CURVE Public Certificate",
        "Give it to the peers that should trust this node: they put it in",
        "their trusted directory (curve_trusted).",
    ]
    # The secret first: a public certificate without its secret is useless.
    for path, head, lines, mode in (
        (paths[1], secret_head, [*body, f'    secret-key = "{secret}"'], 0o600),
        (paths[0], public_head, body, 0o644),
    ):
        header = [f"#   ****  Generated on {now} by p2pactor keygen  ****"]
        text = "\n".join([*header, *(f"#   {h}" for h in head), "", *lines]) + "\n"
        _write_new(path, text, mode, replace=force)
    return paths


def _write_new(path: Path, text: str, mode: int, *, replace: bool) -> None:
    """Write ``path`` whole or not at all, created with ``mode`` (never wider).

    Through a temporary file made with the final mode (the secret is never
    readable by others, not even for a moment), renamed over the target
    (``replace``) or hard-linked to it (which fails if it appeared meanwhile).
    """
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.write(fd, text.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(temp, mode)  # the umask may have narrowed it: public files are world-readable
        if replace:
            os.replace(temp, path)
        else:
            os.link(temp, path)
    except FileExistsError:
        raise ConfigError(f"{path} already exists: pass --force to replace it") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


def _frozen_map(value: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class Keyring:
    """The peers a node trusts: each peer id (``host:port``) and its one public key.

    Built by :func:`load_keyring` (or directly, in tests).

    Attributes:
        keys: Peer id -> public key (Z85).
        directory: Where it was loaded from, for messages; None if made in memory.
    """

    keys: Mapping[str, str] = attrs.field(converter=_frozen_map, hash=False)
    directory: str | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def key_for(self, peer_id: str) -> str | None:
        """The public key trusted for ``peer_id``, or None if none is."""
        return self.keys.get(peer_id)

    # The two below go over every key: they answer a new connection (ZAP) or
    # name an impostor, never a frame of a known peer (key_for is a dict lookup).

    def addresses_of(self, public_key: str) -> frozenset[str]:
        """The peer ids ``public_key`` speaks for (empty if it is not trusted)."""
        return frozenset(address for address, key in self.keys.items() if key == public_key)

    def trusts(self, public_key: str) -> bool:
        """Whether ``public_key`` belongs to a trusted peer."""
        return public_key in self.keys.values()

    def where(self) -> str:
        """The trusted directory, for messages."""
        return self.directory or "the trusted keyring"


def load_keyring(directory: str | os.PathLike[str]) -> Keyring:
    """Every ``*.key`` certificate in ``directory``, as a :class:`Keyring`.

    Other files (``*.key_secret`` among them, so a node's own secret may sit
    beside its peers' keys) are ignored. The directory is read once: restart
    the node to trust a new peer.

    Raises:
        ConfigError: The directory is missing or holds no ``*.key`` file; a
            file is not a usable public certificate; or two files bind one
            address to different keys.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(
            f"the CURVE trusted directory {folder} does not exist or is not a directory: "
            f"create it and copy the {PUBLIC_SUFFIX} file of every peer to trust into it"
        )
    keys: dict[str, tuple[str, Path]] = {}  # address -> its key, and the file that says so
    files = sorted(p for p in folder.glob("*" + PUBLIC_SUFFIX) if p.is_file())
    if not files:
        raise ConfigError(
            f"the CURVE trusted directory {folder} holds no {PUBLIC_SUFFIX} file, so this "
            f"node would trust no peer: copy the {PUBLIC_SUFFIX} file of every peer to trust "
            "into it (made by `p2pactor keygen` on each peer)"
        )
    for file in files:
        key, addresses = load_public(file)
        for address in sorted(addresses):
            if keys.setdefault(address, (key, file))[0] != key:
                raise ConfigError(
                    f"{keys[address][1]} and {file} bind {address} to different keys: one "
                    "of them is stale; remove it (a node id must have exactly one key)"
                )
    return Keyring(keys={a: key for a, (key, _) in keys.items()}, directory=str(folder))


@attrs.frozen(kw_only=True)
class CurveSecurity:
    """What a node needs to authenticate and encrypt its control channel.

    Attributes:
        keypair: This node's own key pair.
        keyring: The peers it trusts, inbound and outbound.
    """

    keypair: CurveKeypair
    keyring: Keyring

    @classmethod
    def load(
        cls, secret_key: str | os.PathLike[str], trusted: str | os.PathLike[str]
    ) -> CurveSecurity:
        """Read the node's secret certificate and its trusted directory.

        Raises:
            ConfigError: See :func:`load_secret` and :func:`load_keyring`.
        """
        return cls(keypair=load_secret(secret_key), keyring=load_keyring(trusted))

    def trusts(self, peer_id: str) -> bool:
        """Whether a key is trusted for ``peer_id`` (so it may be dialed)."""
        return peer_id in self.keyring.keys
