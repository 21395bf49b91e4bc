"""ZPL, the text format of ZeroMQ certificates (czmq's ``zcert``): write and read them.

Only what certificates use: sections at the root, ``name = value`` one level
down (4 spaces), comments and blank lines. Every problem is a
:class:`~p2pactor.errors.ConfigError` naming the file and line.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from p2pactor.errors import ConfigError

_NAME: Final = re.compile(r"[A-Za-z0-9$\-_@.&+/]+")


def render(kind: str, sections: Mapping[str, Mapping[str, str]]) -> str:
    """A certificate's text: a header saying what it is (``kind``), then ``sections``.

    ``kind`` is "secret" or "public": the header warns or says whom to give it.
    """
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"#   ****  Generated on {now} by p2pactor keygen  ****"]
    if kind == "secret":
        lines += [
            "#   ZeroMQ CURVE **Secret** Certificate",
            "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.",
        ]
    else:
        lines += [
            "#   ZeroMQ CURVE Public Certificate",
            "#   Give it to the peers that should trust this node: they put it in",
            "#   their trusted directory (curve_trusted).",
        ]
    lines.append("")
    for section, values in sections.items():
        lines.append(section)
        # ZPL has no escapes: a value holds any character but the quote around it.
        # Ours never hold '"' nor a newline: Z85 keys, and addresses keys.py checked.
        lines += [f'    {name} = "{value}"' for name, value in values.items()]
    return "\n".join(lines) + "\n"


def _parse_value(rest: str, path: Path, number: int) -> str:
    """The value after ``=``: quoted (``#`` inside is text: z85 uses it) or bare."""
    rest = rest.strip()
    if rest[:1] in ("'", '"'):
        end = rest.find(rest[0], 1)
        if end < 0:
            raise ConfigError(f"{path}, line {number}: a quoted value is not closed")
        trailing = rest[end + 1 :].strip()
        if trailing and not trailing.startswith("#"):
            raise ConfigError(f"{path}, line {number}: text after the quoted value")
        return rest[1:end]
    return rest.split("#", 1)[0].strip()


def parse(text: str, path: Path) -> dict[str, dict[str, str]]:
    """The two levels of the certificate ``text``, from ``path``: ``{section: {name: value}}``.

    Raises:
        ConfigError: A line is not ZPL a certificate uses (names ``path`` and the line).
    """
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        if "\t" in line[: len(line) - len(stripped) + 1]:
            raise ConfigError(f"{path}, line {number}: indented with a tab (ZPL uses 4 spaces)")
        indent = len(line) - len(stripped)
        name, eq, rest = stripped.partition("=")
        name = name.strip()
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{path}, line {number}: {name!r} is not a ZPL name")
        if indent == 0:  # a section; a value at the root (no certificate has one) is ignored
            current = None if eq else sections.setdefault(name, {})
        elif indent == 4 and current is not None:
            current[name] = _parse_value(rest, path, number) if eq else ""
        elif indent % 4:
            raise ConfigError(f"{path}, line {number}: indentation is not a multiple of 4 spaces")
        # Deeper levels, or children of a root value: nothing a certificate needs.
    return sections
