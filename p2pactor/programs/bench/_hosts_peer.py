"""The processes of ``p2pactor bench``'s ``hosts`` section, run on namespaced hosts.

* ``fetch SPEC``: the data-plane section's own measurement
  (:func:`p2pactor.programs.bench.dataplane._measure_group`: ours, raw NIXL and
  memcpy), its consumer node at ``SPEC["address"]`` and its producer on the
  host ``SPEC["peer"]``; prints the figures, one ``fetch`` line;
* ``lookups SPEC``: a node at ``SPEC["address"]`` looking up one key at a time
  on a data-plane producer started on ``SPEC["peer"]`` (or on this host, where
  ``peer`` is null, both on ``127.0.0.1``); prints every lookup's seconds, one
  ``lookups`` line.

``SPEC`` is a JSON object; ``peer`` is ``{"name", "netns", "address"}`` of a
:class:`~p2pactor.programs.hosts.Host`. Lines read back are prefixed
:data:`~p2pactor.programs.bench._dataplane_peer.PREFIX`.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.lowlevel

from p2pactor.programs.bench._dataplane_peer import (
    PREFIX,
    bench_config,
    bench_keys,
    producer_argv,
)
from p2pactor.programs.hosts import Host

LOOPBACK = "127.0.0.1"

LOOKUP_BLOCKS = 4
"""Blocks of the lookup loop's producer (one of them is looked up)."""

LOOKUP_BLOCK_LEN = 4096
"""Bytes per block of the lookup loop's nodes."""


def _say(**message: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def _host(peer: dict[str, str] | None) -> Host | None:
    return None if peer is None else Host(peer["name"], peer["netns"], peer["address"])


def _fetch(spec: dict[str, Any]) -> None:
    from p2pactor.programs.bench import dataplane  # noqa: PLC0415

    host = _host(spec["peer"])
    if host is None:
        raise ValueError("fetch needs a peer host")
    found = trio.run(
        functools.partial(
            dataplane._measure_group,  # the data-plane section's own measurement
            spec["block_len"],
            spec["counts"],
            spec["repeats"],
            spec["iters"],
            spec["work_dir"],
            address=spec["address"],
            producer_on=host,
        )
    )
    _say(event="fetch", measured={str(c): attrs.asdict(m) for c, m in found.items()})


async def _lookups(spec: dict[str, Any]) -> list[list[float]]:
    """Every repeat's single-key lookup seconds, node at ``address`` to the peer's."""
    import torch  # noqa: PLC0415 - heavy; only the benchmark's processes need it

    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
    from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415
    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.programs.bench.dataplane import _Lines  # noqa: PLC0415
    from p2pactor.runtime.node import open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415

    address: str = spec["address"]
    host = _host(spec["peer"])
    argv = producer_argv(
        LOOKUP_BLOCKS, LOOKUP_BLOCK_LEN, LOOPBACK if host is None else host.address
    )
    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    where = "loopback" if host is None else host.name
    with (Path(spec["work_dir"]) / f"hosts-lookups-{where}.stderr").open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            argv if host is None else host.command(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env if host is None else host.env(env),
        )
    runs: list[list[float]] = []
    try:
        with trio.fail_after(120):
            lines = _Lines(process)
            peer: str = (await lines.read("ready"))["node_id"]
            pool = torch.zeros(LOOKUP_BLOCKS * LOOKUP_BLOCK_LEN, dtype=torch.uint8)
            cache = EmbeddedCache(LOOKUP_BLOCKS, LOOKUP_BLOCK_LEN, memory=pool.numpy().data)
            keys = bench_keys(LOOKUP_BLOCKS, LOOKUP_BLOCK_LEN)[:1]
            async with (
                open_zmq_transport(f"{address}:0", port=0) as control,
                open_nixl_transport(pool, LOOKUP_BLOCK_LEN, name="bench-lookups") as data,
            ):
                config = bench_config(control.local_id, LOOKUP_BLOCKS, LOOKUP_BLOCK_LEN)
                async with open_node(config, control=control, data=data, parent=cache) as node:
                    ids = itertools.count()

                    async def one() -> float:
                        rid = f"lookup-{next(ids)}"
                        start = time.perf_counter()
                        answers = await node.lookup(peer, rid, keys)
                        elapsed = time.perf_counter() - start
                        node.finish(rid)
                        if answers != [LookupResult.HIT]:
                            raise RuntimeError(f"lookup answered {answers}")
                        return elapsed

                    for _ in range(spec["warmup"]):
                        await one()
                    for _ in range(spec["repeats"]):
                        times = [await one() for _ in range(spec["count"])]
                        runs.append(times)
            assert process.stdin is not None
            await process.stdin.send_all(b'{"cmd": "exit"}\n')
            with trio.move_on_after(30):
                await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
    return runs


def main() -> None:
    """Entry point: ``python -m p2pactor.programs.bench._hosts_peer ROLE ARGS...``."""
    role, *args = sys.argv[1:]
    if role == "fetch":
        _fetch(json.loads(args[0]))
    elif role == "lookups":
        _say(event="lookups", runs=trio.run(_lookups, json.loads(args[0])))
    else:
        raise SystemExit(f"unknown role {role!r}: fetch or lookups")


if __name__ == "__main__":
    main()
