"""A NIXL peer in its own process, for ``tests/test_nixl.py``.

Run as ``python tests/nixl_peer.py NUM_BLOCKS BLOCK_LEN [thread|pump]``. It
opens a :class:`~p2pactor.adapters.nixl.NixlDataTransport` over a zeroed pool
and prints one line, ``READY <metadata hex> <base_addr> <num_blocks>
<block_len>``, that a test uses to register it as a peer. Its agent makes
progress while the test WRITEs into the pool: by NIXL's progress thread
(``thread``, the default, with nothing expected of the pump) or by its pump
(``pump``: the thread off, one write expected all along). Then, for each line on
stdin:

* ``SUM i j ...``: prints ``SUM <sha256 hex>`` of blocks i, j, ... concatenated;
* ``ZEROS``: prints ``ZEROS <n>``, the number of blocks that are all zero;
* ``POLLS``: prints ``POLLS <thread> <n>``: whether NIXL's progress thread runs
  (0 or 1), and how often the pump drove the agent's progress;
* ``EXIT`` (or end of input): closes the transport and exits 0.

Protocol lines start with a keyword; anything else on stdout (NIXL's own logs)
is to be ignored by the reader.
"""

from __future__ import annotations

import hashlib
import os
import sys

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import trio

from p2pactor.adapters.nixl import NixlOptions, open_nixl_transport


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main(num_blocks: int, block_len: int, progress: str) -> None:
    pool = bytearray(num_blocks * block_len)
    stdin = trio.wrap_file(sys.stdin)
    options = NixlOptions(progress_thread_wakeup=None) if progress == "pump" else None
    async with open_nixl_transport(pool, block_len, name="peer", options=options) as data:
        if progress == "pump":
            # A pool other processes write into, whenever they like: its agent
            # must make progress all along, as a node's does while it has loads.
            data.expect_writes(1)
        say(f"READY {data.agent_metadata.hex()} {data.base_addr} {num_blocks} {block_len}")
        while True:
            words = (await stdin.readline()).split()
            if not words or words[0] == "EXIT":
                break
            if words[0] == "SUM":
                digest = hashlib.sha256()
                for i in map(int, words[1:]):
                    digest.update(pool[i * block_len : (i + 1) * block_len])
                say(f"SUM {digest.hexdigest()}")
            elif words[0] == "ZEROS":
                zero = bytes(block_len)
                count = sum(
                    pool[i * block_len : (i + 1) * block_len] == zero for i in range(num_blocks)
                )
                say(f"ZEROS {count}")
            elif words[0] == "POLLS":
                stats = data.statistics()
                say(f"POLLS {int(stats.progress_thread)} {stats.progress_polls}")
            else:
                say(f"ERROR unknown command {words[0]!r}")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]), (sys.argv[3:] or ["thread"])[0])
