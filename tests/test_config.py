"""NodeConfig: vLLM's defaults and environment variables, validation, fingerprints."""

from __future__ import annotations

import hashlib
import json

import pytest

from p2pactor.errors import ConfigError
from p2pactor.runtime.config import DEFAULT_HASH_SEED, NodeConfig, fingerprint_of


def test_defaults_are_vllms() -> None:
    cfg = NodeConfig.from_env({})
    assert (cfg.host, cfg.port) == ("localhost", 5710)
    assert cfg.node_id == "localhost:5710"
    assert cfg.max_peers == 128
    assert cfg.handshake_timeout == 30.0
    assert cfg.idle_timeout == 300.0
    assert cfg.hash_seed == DEFAULT_HASH_SEED == "vllm-none-hash"
    assert cfg.session_outbox == 1000  # vLLM's SNDHWM
    assert cfg.max_dispatch_errors == 5
    t = cfg.timings
    assert (t.load_timeout, t.abort_ack_timeout, t.pending_timeout, t.pin_timeout) == (
        30.0,
        10.0,
        5.0,
        30.0,
    )


def test_vllm_environment_variables_are_read() -> None:
    cfg = NodeConfig.from_env(
        {
            "VLLM_P2P_SIDE_CHANNEL_HOST": "10.1.2.3",
            "VLLM_P2P_SIDE_CHANNEL_PORT": "6000",
            "VLLM_P2P_MAX_PEERS": "16",
            "VLLM_P2P_HANDSHAKE_TIMEOUT_S": "5.5",
            "VLLM_P2P_IDLE_TIMEOUT_S": "60",
            "PYTHONHASHSEED": "1234",
            "P2PACTOR_NUM_BLOCKS": "4096",
            "P2PACTOR_BLOCK_LEN": "131072",
            "P2PACTOR_ALLOWED_PEERS": "10.1.2.4:6000, 10.1.2.5:6000",
        }
    )
    assert cfg.node_id == "10.1.2.3:6000"
    assert cfg.max_peers == 16
    assert cfg.handshake_timeout == 5.5
    assert cfg.idle_timeout == 60.0
    assert cfg.hash_seed == "1234"
    assert (cfg.num_blocks, cfg.block_len) == (4096, 131072)
    assert cfg.allowed_peers == frozenset({"10.1.2.4:6000", "10.1.2.5:6000"})
    assert cfg.may_dial("10.1.2.4:6000")
    assert not cfg.may_dial("evil:6000")


def test_keyword_overrides_win_over_the_environment() -> None:
    cfg = NodeConfig.from_env({"VLLM_P2P_SIDE_CHANNEL_PORT": "6000"}, port=7000)
    assert cfg.port == 7000


def test_a_bad_variable_is_named_in_the_error() -> None:
    with pytest.raises(ConfigError, match="VLLM_P2P_SIDE_CHANNEL_PORT='http' is not a valid int"):
        NodeConfig.from_env({"VLLM_P2P_SIDE_CHANNEL_PORT": "http"})


@pytest.mark.parametrize(
    ("field", "value"),
    [("port", 70000), ("num_blocks", 0), ("block_len", -1), ("handshake_timeout", 0.0)],
)
def test_out_of_range_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        NodeConfig(**{field: value})  # type: ignore[arg-type]


def test_allowed_peers_must_be_a_collection() -> None:
    with pytest.raises(ConfigError, match="not one string"):
        NodeConfig(allowed_peers="a:1")  # type: ignore[arg-type]


def test_the_unused_actor_inbox_still_loads_but_warns() -> None:
    assert NodeConfig().actor_inbox == 256  # the default says nothing
    with pytest.warns(DeprecationWarning, match="actor_inbox does nothing"):
        config = NodeConfig(actor_inbox=64)
    assert config.actor_inbox == 64


def test_fingerprint_is_vllms() -> None:
    fields = {"model": "m", "dtype": "bfloat16", "block_size": 16}
    expected = hashlib.sha256(
        json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()[:16]
    assert fingerprint_of(fields) == expected
    assert fingerprint_of({"dtype": "bfloat16", "block_size": 16, "model": "m"}) == expected
    assert fingerprint_of({}) == ""
