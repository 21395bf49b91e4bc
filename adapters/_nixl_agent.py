"""The block pool as its NIXL agent sees it, and the calls into the agent that may block."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable, Sequence
from logging import INFO, WARNING
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

import attrs
import numpy as np
import numpy.typing as npt

from p2pactor.adapters._nixl_options import NixlOptions, note, ucx_tcp_environment
from p2pactor.errors import ConfigError, DataPlaneError

if TYPE_CHECKING:
    import torch

MAX_BLOCKS = 2**31 - 1  # NIXL takes descriptor indexes as int32
PER_BLOCK_LIMIT = 65_536
"""The most blocks of a peer's pool prepared one descriptor per block, only when NIXL
refuses the pool as one strided row (it spans several registrations): at most about
6 MiB at the peak and 4-7 ms of a worker thread (measured), whatever the peer advertises."""

Index = npt.NDArray[np.int32]
Descs = npt.NDArray[np.uint64]


class Agent(Protocol):
    """The part of ``nixl_agent`` the transport uses, typed (NIXL has no stubs; handles opaque)."""

    def get_agent_metadata(self) -> bytes: ...
    def register_memory(
        self, reg_list: list[tuple[int, int, int, str]], mem_type: str
    ) -> object: ...
    def deregister_memory(self, dereg_list: object) -> None: ...
    def prep_xfer_dlist(self, agent_name: str, xfer_list: Descs, mem_type: str) -> object: ...
    def release_dlist_handle(self, handle: object) -> None: ...
    def add_remote_agent(self, metadata: bytes) -> str | bytes: ...
    def remove_remote_agent(self, agent: str) -> None: ...
    def make_connection(self, remote_agent: str) -> None: ...
    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: object,
        local_indices: Index,
        remote_xfer_side: object,
        remote_indices: Index,
    ) -> object: ...
    def transfer(self, handle: object) -> str: ...
    def check_xfer_state(self, handle: object) -> str: ...
    def release_xfer_handle(self, handle: object) -> None: ...
    def get_new_notifs(self) -> dict[str, list[bytes]]: ...


@attrs.frozen
class Posted:
    """What posting a write gave: its handle (None: NIXL could not prepare it) and state."""

    handle: object | None
    state: str  # as transfer() returned it; "ERR" if it raised
    why: str  # what its failure would say
    seconds: float | None = None  # how long the post took, if transfer() returned


def nixl_error(exc: Exception) -> str:
    """How an exception NIXL raised reads in a message."""
    return f"{type(exc).__name__}: {exc}"


# Held while NIXL's module is swapped for the stand-in in _new_agent.
_NEW_AGENT_LOCK = threading.Lock()


def _new_agent(api: ModuleType, name: str, config: object, wakeup: float | None) -> Agent:
    """``api.nixl_agent(name, config)``, its progress thread waking every ``wakeup`` s.

    NIXL's Python constructor writes ``pthrDelay = 0`` into the C++ config it
    builds, which makes the thread's ``poll()`` timeout 0: it spins a core. The
    binding takes any delay, so the constructor runs against a stand-in for the
    binding module that sets ours on the way to the real ``nixlAgent``. Every
    other name passes through, so another thread using NIXL meanwhile is
    unaffected; the lock keeps two constructions from swapping at once.
    """
    if wakeup is None:
        return cast(Agent, api.nixl_agent(name, config))
    delay_us = max(1, round(wakeup * 1e6))
    binding: Any = getattr(api, "nixlBind")  # noqa: B009 (not in NIXL's stubs)

    class _WithDelay:
        def __getattr__(self, attr: str) -> object:
            return getattr(binding, attr)

        def nixlAgent(self, agent_name: str, agent_config: Any) -> object:  # noqa: N802
            agent_config.pthrDelay = delay_us
            return binding.nixlAgent(agent_name, agent_config)

    with _NEW_AGENT_LOCK:
        setattr(api, "nixlBind", _WithDelay())  # noqa: B010
        try:
            return cast(Agent, api.nixl_agent(name, config))
        finally:
            setattr(api, "nixlBind", binding)  # noqa: B010


def _address(pool: torch.Tensor | bytearray | memoryview) -> tuple[int, int, object]:
    """A host-memory pool's address, bytes, and what owns the memory."""
    torch_mod = sys.modules.get("torch")  # a tensor exists only if torch is imported
    if torch_mod is not None and isinstance(pool, torch_mod.Tensor):
        tensor = cast("torch.Tensor", pool)
        if tensor.device.type != "cpu":
            raise ConfigError(
                f"the block pool must be in host memory (DRAM), not on {tensor.device}"
            )
        if not tensor.is_contiguous():
            raise ConfigError("the block pool tensor must be contiguous")
        return tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor
    try:
        view = memoryview(cast("bytearray | memoryview", pool))
    except TypeError:
        raise ConfigError(
            "the block pool must be a CPU torch tensor or a writable buffer "
            f"(bytearray, memoryview), not {type(pool).__name__}"
        ) from None
    if view.readonly or not view.c_contiguous:
        raise ConfigError("the block pool buffer must be writable and contiguous")
    view = view.cast("B")
    # from_buffer exports the buffer: a bytearray cannot be resized (and so
    # moved) while NIXL has its address registered.
    array = (ctypes.c_char * view.nbytes).from_buffer(view)
    return ctypes.addressof(array), view.nbytes, array


def _strided(base_addr: int, num_blocks: int, block_len: int) -> Descs:
    """The pool as one strided row, ``(address, length, device 0, stride, count)``.

    NIXL (1.5 on, which p2pactor requires) prepares an Nx5 array as a
    compressed list: index ``i`` names block ``i`` exactly as in a list of one
    row per block, but preparing and keeping it costs the same for 16 blocks
    as for 2**31 - 1. A per-block list peaked at about 72 bytes a block (274 MiB
    for 4,000,000) and held the GIL for about 0.1 s of that, and a peer chooses
    how many blocks it advertises (issue 30).
    """
    return np.array([[base_addr, block_len, 0, block_len, num_blocks]], dtype=np.uint64)


class Pool:
    """The block pool registered with one NIXL agent, and the calls that may block on it.

    The base of :class:`~p2pactor.adapters.nixl.NixlDataTransport`: the calls
    here run in a worker thread (or are quick), under the transport's lock.
    """

    def __init__(
        self,
        pool: torch.Tensor | bytearray | memoryview,
        block_len: int,
        name: str,
        options: NixlOptions,
    ) -> None:
        if type(block_len) is not int or block_len <= 0:
            raise ConfigError(f"block_len must be a positive int, got {block_len!r}")
        self.base_addr, nbytes, self._keepalive = _address(pool)
        if nbytes == 0 or nbytes % block_len:
            raise ConfigError(
                f"the block pool ({nbytes} bytes) must be a whole, non-zero number of "
                f"{block_len}-byte blocks"
            )
        if nbytes // block_len > MAX_BLOCKS:
            raise ConfigError(f"the block pool has more than {MAX_BLOCKS} blocks")
        self.agent_name = name
        self.num_blocks = nbytes // block_len
        self.block_len = block_len
        self._options = options
        self._agent: Agent | None = None  # set once open; None again once closed
        self._registration: object | None = None
        self._local_dlist: object | None = None  # the pool's prepared (strided) list
        self.agent_metadata = b""  # once the agent is open
        # NIXL's progress thread runs: the pump need not drive progress.
        self._threaded = options.progress_thread_wakeup is not None
        self.late_write_window = 0.0  # from the UCX TCP timeout in effect, once open

    def _attempt(self, what: str, call: Callable[[Any], object], arg: object | None) -> None:
        """Make one NIXL call (none if ``arg`` is None); log a failure (and go on)."""
        if arg is not None:
            try:
                call(arg)
            except Exception as exc:
                why = nixl_error(exc)
                line = "%s failed: %s (NIXL_LOG_LEVEL=INFO shows why)"
                note(WARNING, self.agent_name, line, what, why)

    def _open(self, api: ModuleType) -> Agent:
        """Make the agent, register the pool and prepare its descriptors."""
        options = self._options
        try:
            config = api.nixl_agent_config(
                enable_prog_thread=self._threaded,
                backends=list(options.backends),
                num_threads=options.num_threads,
            )
            self.late_write_window = ucx_tcp_environment(options)
            agent = _new_agent(api, self.agent_name, config, options.progress_thread_wakeup)
        except Exception as exc:
            raise DataPlaneError(
                f"cannot create the NIXL agent ({nixl_error(exc)}); check that the NIXL "
                f"wheel has the {'/'.join(options.backends)} backend plugin(s)"
            ) from exc
        nbytes = self.num_blocks * self.block_len
        try:
            self._registration = agent.register_memory(
                [(self.base_addr, nbytes, 0, "")], mem_type="DRAM"
            )
            # One registration, so one strided row covers it (see _strided).
            self._local_dlist = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                _strided(self.base_addr, self.num_blocks, self.block_len),
                mem_type="DRAM",
            )
            # Taken after registering: the metadata carries the registered region.
            self.agent_metadata = agent.get_agent_metadata()
        except Exception as exc:
            self._release_pool(agent)
            raise DataPlaneError(
                f"cannot register the {nbytes}-byte block pool with NIXL: {nixl_error(exc)}"
            ) from exc
        return agent

    def _release_pool(self, agent: Agent) -> None:
        """Release the pool's descriptors, then its registration.

        Each release is attempted on its own: one that fails does not keep the
        other (the memory registration above all) alive.
        """
        self._attempt(
            "releasing the pool's descriptors", agent.release_dlist_handle, self._local_dlist
        )
        self._attempt("deregistering the pool", agent.deregister_memory, self._registration)
        self._local_dlist = self._registration = None

    def _add_peer(
        self,
        agent: Agent,
        metadata: bytes,
        pools: Sequence[tuple[int, int]],
        known: frozenset[str],
        stale: tuple[str, Sequence[object]] | None = None,
    ) -> tuple[str, list[object]] | str:
        """Load a peer's agent, prepare each of its ``pools``: (agent name, lists), or why not.

        ``pools`` are ``(base_addr, num_blocks)``, each one strided row however
        many blocks it has (:func:`_strided`). ``stale``: an agent and its lists,
        released first, so that it is loaded afresh, with a new connection.
        """
        if stale is not None:
            for dlist in stale[1]:
                self._remove_peer(agent, dlist, None)
            self._remove_peer(agent, None, stale[0])
        try:
            name = agent.add_remote_agent(metadata)
        except Exception as exc:
            return f"its agent metadata was rejected ({nixl_error(exc)})"
        remote = name.decode() if isinstance(name, bytes) else name
        prepared: list[object] = []
        try:
            for base_addr, num_blocks in pools:
                prepared.append(self._peer_dlist(agent, remote, base_addr, num_blocks))
            if self._options.connect_eagerly:
                agent.make_connection(remote)
        except Exception as exc:
            for dlist in prepared:
                self._remove_peer(agent, dlist, None)
            # Another name may use this agent: only a first registration is undone.
            self._remove_peer(agent, None, None if remote in known else remote)
            return str(exc) if isinstance(exc, DataPlaneError) else nixl_error(exc)
        return remote, prepared

    def _peer_dlist(self, agent: Agent, remote: str, base_addr: int, num_blocks: int) -> object:
        """Prepare a peer's pool as one strided row; block by block if NIXL refuses that.

        NIXL takes a strided row only inside one registered region. vLLM and
        p2pactor register their pool as one; a peer whose pool spans several
        gets a per-block list, but only up to :data:`PER_BLOCK_LIMIT` blocks.
        """
        try:
            return agent.prep_xfer_dlist(
                remote, _strided(base_addr, num_blocks, self.block_len), mem_type="DRAM"
            )
        except Exception as exc:
            if num_blocks > PER_BLOCK_LIMIT:
                raise DataPlaneError(
                    f"NIXL refused its {num_blocks}-block pool as one registered region "
                    f"({nixl_error(exc)}), and a pool of more than {PER_BLOCK_LIMIT} blocks "
                    "is not prepared block by block"
                ) from exc
        # One (address, length, device 0) row per block.
        descs = np.zeros((num_blocks, 3), dtype=np.uint64)
        descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(self.block_len)
        descs[:, 1] = self.block_len
        dlist = agent.prep_xfer_dlist(remote, descs, mem_type="DRAM")
        what = "agent %s's pool spans several registrations: its %d blocks are prepared one by one"
        note(INFO, self.agent_name, what, remote, num_blocks)
        return dlist

    def _remove_peer(self, agent: Agent, dlist: object | None, remote: str | None) -> None:
        """Release a peer's descriptors and, unless ``remote`` is None, its agent."""
        self._attempt("releasing a peer's descriptors", agent.release_dlist_handle, dlist)
        self._attempt(f"removing remote agent {remote}", agent.remove_remote_agent, remote)

    def _post(self, agent: Agent, local: Index, peer_dlist: object, remote: Index) -> Posted:
        """Make and post one WRITE of our blocks ``local`` into the peer's ``remote``.

        ``transfer()`` may copy everything before it returns (shared memory):
        then its state is DONE already.
        """
        start = time.perf_counter()
        try:
            handle = agent.make_prepped_xfer("WRITE", self._local_dlist, local, peer_dlist, remote)
        except Exception as exc:
            return Posted(None, "ERR", f"NIXL could not prepare the write: {nixl_error(exc)}")
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            return Posted(handle, "ERR", nixl_error(exc))
        return Posted(handle, state, f"transfer() returned {state}", time.perf_counter() - start)
