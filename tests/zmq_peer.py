"""A tiny peer on the ZeroMQ control transport, run as a separate process by tests.

It binds ``--host:--port`` (0: an ephemeral port), prints ``READY host:port`` on
stdout, optionally dials ``--dial`` and sends ``TAG:hello`` then ``--burst``
frames ``TAG:0``, ``TAG:1``, ...; it answers every frame it receives on any
connection with ``TAG:echo:FRAME``. It runs until it is killed.
"""

from __future__ import annotations

import argparse

import trio

from p2pactor.adapters.zmq import ZmqConnection, ZmqOptions, open_zmq_transport
from p2pactor.runtime.transport import ConnectionLost


async def echo(conn: ZmqConnection, tag: bytes) -> None:
    try:
        while True:
            frame = await conn.receive()
            await conn.send(tag + b":echo:" + frame)
    except ConnectionLost:
        return


async def main(args: argparse.Namespace) -> None:
    options = ZmqOptions(
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_ttl=args.heartbeat_timeout,
    )
    tag = args.tag.encode()
    async with (
        open_zmq_transport(f"{args.host}:{args.port}", port=args.port, options=options) as zt,
        trio.open_nursery() as nursery,
    ):
        print(f"READY {zt.local_id}", flush=True)
        if args.dial:
            conn = await zt.connect(args.dial)
            await conn.send(tag + b":hello")
            for i in range(args.burst):
                await conn.send(tag + b":" + str(i).encode())
            nursery.start_soon(echo, conn, tag)
        while True:
            nursery.start_soon(echo, await zt.accept(), tag)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dial", default=None)
    parser.add_argument("--tag", default="peer")
    parser.add_argument("--burst", type=int, default=0)
    parser.add_argument("--heartbeat-interval", type=float, default=0.2)
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    trio.run(main, parser.parse_args())
