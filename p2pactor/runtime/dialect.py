"""The dialects a session speaks: what our ``connect`` offers and requires, what a peer may hear.

A stock vLLM peer speaks the base protocol; a p2pactor peer says in its
``connect`` which of p2pactor's extensions it speaks (``docs/protocol.md``,
"Extensions"). The features both sides offer are the session's
(:func:`agreed`); a message leaves without the fields its peer does not speak
(:func:`to_dialect`). All pure but :func:`connect_message`, which names this process.
"""

from __future__ import annotations

from msgspec.structs import replace

from p2pactor.core import protocol as wire
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.process import this_process
from p2pactor.runtime.transport import DataTransport

FEATURE_RESP_ROUND = "lookup_resp_round"
"""A ``lookup_resp`` carries the ``round_seq`` of the lookup it answers."""
FEATURE_SESSION_ROUNDS = "session_rounds"
"""Rounds come from one counter per session, which never repeats (no ABA on a reused id)."""
FEATURE_DEADLINE = "lookup_deadline"
"""A ``lookup`` carries its ``deadline_ms``."""
FEATURE_REFUSED = "lookup_refused"
"""A ``lookup_resp`` says which of its MISSes are a quota's refusals (``refused``)."""
EXTENSION = wire.ConnectExtension(
    version=1,
    features=frozenset(
        {FEATURE_RESP_ROUND, FEATURE_SESSION_ROUNDS, FEATURE_DEADLINE, FEATURE_REFUSED}
    ),
)
"""What this p2pactor offers peers in its ``connect`` (and summaries, when it shares them)."""


def _offered(config: NodeConfig) -> frozenset[str]:
    return EXTENSION.features | ({wire.FEATURE_SUMMARIES} if config.sources.share else set())


def connect_message(config: NodeConfig, data: DataTransport, hash_seed: str) -> wire.Connect:
    """This node's ``connect``: its memory, its configuration, and what it speaks."""
    return wire.Connect(
        peer_id=config.node_id,
        agent_metadata=data.agent_metadata,
        base_addr=data.base_addr,
        num_blocks=data.num_blocks,
        block_len=data.block_len,
        config_fingerprint=config.fingerprint,
        hash_seed=hash_seed,
        extension=replace(EXTENSION, features=_offered(config), process=this_process())
        if config.round_extension
        else wire.UNSET,
    )


def agreed(config: NodeConfig, peer: wire.ConnectExtension | None) -> frozenset[str]:
    """The features both this node and a peer offering ``peer`` (None: vLLM's base) speak."""
    return _offered(config) & peer.features if peer is not None else frozenset()


def incompatibility(
    msg: wire.Connect, peer_id: str, config: NodeConfig, hash_seed: str
) -> tuple[str, str]:
    """``(outcome, problem)``: why ``peer_id`` can't be talked to (for metrics, for people).

    ``("", "")`` when it can.
    """
    if msg.peer_id != peer_id:
        return "identity_mismatch", (
            f"it connected as {msg.peer_id!r} but its connection says {peer_id!r}; "
            "a peer's id must be the host:port it bound"
        )
    if msg.block_len != config.block_len:
        return "block_size_mismatch", (
            f"block size differs: {peer_id} uses {msg.block_len}-byte blocks, this node "
            f"{config.block_len}; every peer must use the same KV block layout"
        )
    ours = config.fingerprint
    if msg.config_fingerprint and ours and msg.config_fingerprint != ours:
        return "fingerprint_mismatch", (
            f"config fingerprint differs ({msg.config_fingerprint} vs {ours}): "
            "the peers run different models, dtypes or block sizes; align them"
        )
    if msg.hash_seed != hash_seed:
        return "seed_mismatch", (
            f"hash seed differs ({msg.hash_seed!r} vs {hash_seed!r}): the same tokens "
            "would get different keys; set PYTHONHASHSEED to the same value on every node"
        )
    return "", ""


def to_dialect(msg: wire.Message, features: frozenset[str]) -> wire.Message:
    """``msg`` without the extension fields a peer speaking only ``features`` does not speak."""
    if isinstance(msg, wire.Lookup) and FEATURE_DEADLINE not in features:
        return replace(msg, deadline_ms=wire.UNSET)
    if isinstance(msg, wire.LookupResp):
        if FEATURE_RESP_ROUND not in features:
            msg = replace(msg, round_seq=wire.UNSET)
        if FEATURE_REFUSED not in features and msg.refused is not wire.UNSET:
            msg = replace(msg, refused=wire.UNSET)
    return msg
