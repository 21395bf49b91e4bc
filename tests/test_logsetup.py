"""Diagnostic logging: the JSON and text formats, their fields, the CLI flags, stdout hygiene.

The fields are checked on lines that real nodes log (in-memory transports) and
that ``p2pactor serve`` writes as a real process, provoked by a real refusal.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq

from p2pactor.core.inputs import LookupResult
from p2pactor.errors import ConfigError
from p2pactor.programs import replay_cli
from p2pactor.programs.bench import cli as bench_cli
from p2pactor.programs.bench.cli import BenchOptions, SectionResult
from p2pactor.programs.cli import build_parser, main
from p2pactor.runtime.logcontext import parent_request_context, peer_context, request_context
from p2pactor.runtime.quotas import PeerQuotas
from p2pactor.surface.logsetup import (
    FORMAT_ENV,
    LEVEL_ENV,
    ROOT,
    JsonFormatter,
    TextFormatter,
    configure_logging,
)
from tests.cluster import key, open_cluster
from tests.ports import free_port

REPO = Path(__file__).resolve().parent.parent
JSON_KEYS = {"ts", "level", "logger", "message"}


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test may reconfigure the ``p2pactor`` logger; put it back as it was."""
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    logger = logging.getLogger(ROOT)
    saved = (logger.level, logger.propagate, list(logger.handlers))
    yield
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    for handler in saved[2]:
        logger.addHandler(handler)
    logger.setLevel(saved[0])
    logger.propagate = saved[1]


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every non-empty line of ``text`` as a JSON object (fails on any other line)."""
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    for line in lines:
        assert isinstance(line, dict), line
        assert line.keys() >= JSON_KEYS, line
    return lines


def child_env(**extra: str) -> dict[str, str]:
    """Children import p2pactor (and ``tests``) exactly as we do."""
    path = os.pathsep.join([str(REPO), *(p for p in sys.path if p)])
    env = {**os.environ, "PYTHONPATH": path, "NIXL_LOG_LEVEL": "WARN", **extra}
    for name in (FORMAT_ENV, LEVEL_ENV):
        env.pop(name, None)
    return env


# --- lines from real nodes -------------------------------------------------------------------


async def test_json_lines_of_a_real_refusal_carry_peer_and_kv_request_id(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    buffer = io.StringIO()
    configure_logging(level="INFO", fmt="json", stream=buffer)
    async with open_cluster(
        "a", "b", log_dir=tmp_path, quotas=PeerQuotas(max_keys_per_lookup=1)
    ) as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(1), key(2))
        # b looks up only the first key: the quota refuses the rest, and says so.
        assert await a.node.lookup(b.id, "req-7", [key(1), key(2)]) == [
            LookupResult.HIT,
            LookupResult.MISS,
        ]
        a.node.finish("req-7")
    lines = json_lines(buffer.getvalue())
    (refusal,) = [line for line in lines if line["logger"] == "p2pactor.quotas"]
    assert refusal["level"] == "WARNING"
    assert refusal["peer"] == a.id
    assert refusal["kv_request_id"] == "req-7"
    assert "keys_per_lookup" in refusal["message"]
    assert "P2PACTOR_QUOTA_KEYS_PER_LOOKUP" in refusal["message"]  # what to do
    assert refusal["ts"].endswith("Z")
    ready = [line for line in lines if "ready" in line["message"]]
    assert {(line["node"], line["peer"]) for line in ready} == {(a.id, b.id), (b.id, a.id)}
    assert all(line["logger"].startswith("p2pactor.") for line in lines)

    # The event logs those nodes wrote: `replay --json` prints one JSON document on
    # stdout, whatever the logging level, and its log lines (JSON) go to stderr.
    logs = [str(tmp_path / "a.p2plog"), str(tmp_path / "b.p2plog")]
    argv = [sys.executable, "-m", "p2pactor", "--log-format", "json", "replay"]
    run = await trio.run_process(
        [*argv, "--log-level", "debug", "--json", *logs],
        capture_stdout=True,
        capture_stderr=True,
        env=child_env(),
        check=False,
    )
    assert run.returncode == 0, run.stderr
    document = json.loads(run.stdout)
    assert isinstance(document, dict)
    json_lines(run.stderr.decode())


# --- the formatters ----------------------------------------------------------------------


def record(**extra: object) -> logging.LogRecord:
    rec = logging.LogRecord(
        "p2pactor.node", logging.WARNING, __file__, 1, "refused %s", ("x",), None
    )
    rec.created = 0.25  # 1970-01-01T00:00:00.250Z
    for name, value in extra.items():
        setattr(rec, name, value)
    return rec


def test_json_formatter_fields_and_traceback() -> None:
    line = json.loads(JsonFormatter().format(record(**request_context("h:1", "r", node="n:2"))))
    assert line == {
        "ts": "1970-01-01T00:00:00.250Z",
        "level": "WARNING",
        "logger": "p2pactor.node",
        "message": "refused x",
        "node": "n:2",
        "peer": "h:1",
        "kv_request_id": "r",
    }
    rec = record()
    error = RuntimeError("boom\nsecond line")
    rec.exc_info = (RuntimeError, error, None)
    text = JsonFormatter().format(rec)
    assert "\n" not in text  # one line, whatever the traceback holds
    parsed = json.loads(text)
    assert "peer" not in parsed
    assert parsed["exc_info"] == "RuntimeError: boom\nsecond line"


def test_text_formatter_appends_the_request_fields() -> None:
    text = TextFormatter().format(record(**request_context("h:1", "r")))
    assert text.endswith(" WARNING p2pactor.node refused x peer=h:1 kv_request_id=r")
    assert TextFormatter().format(record()).endswith("p2pactor.node refused x")


def test_parent_request_names_give_peer_and_kv_request_id() -> None:
    assert parent_request_context("p2p:10.0.0.1:5710:req:1#2:lu3") == {
        "peer": "10.0.0.1:5710",
        "kv_request_id": "req:1",
    }
    assert parent_request_context("someone else's name", node="n:1") == {"node": "n:1"}


# --- configure_logging -------------------------------------------------------------------


def test_configure_logging_is_idempotent_and_leaves_the_root_alone() -> None:
    root_handlers = list(logging.getLogger().handlers)
    first, second = io.StringIO(), io.StringIO()
    configure_logging(fmt="json", stream=first)
    configure_logging(fmt="json", stream=second)
    logger = logging.getLogger(ROOT)
    logging.getLogger("p2pactor.node").warning("once %d", 1)
    assert first.getvalue() == ""
    assert [line["message"] for line in json_lines(second.getvalue())] == ["once 1"]
    assert logging.getLogger().handlers == root_handlers
    assert logger.propagate is False
    logging.getLogger("p2pactor.node").debug("not at INFO")
    assert len(second.getvalue().splitlines()) == 1


def test_environment_defaults_and_bad_values(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(FORMAT_ENV, "json")
    monkeypatch.setenv(LEVEL_ENV, "warning")
    buffer = io.StringIO()
    configure_logging(stream=buffer)
    logging.getLogger("p2pactor.session").info("hidden")
    logging.getLogger("p2pactor.session").warning("shown")
    assert [line["message"] for line in json_lines(buffer.getvalue())] == ["shown"]
    monkeypatch.setenv(LEVEL_ENV, "loud")
    with pytest.raises(ConfigError, match=LEVEL_ENV):
        configure_logging(stream=buffer)
    capsys.readouterr()
    assert main(["replay", "nothing.p2plog"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("p2pactor: log level 'loud' is not one of DEBUG, INFO")


def test_the_flags_go_before_or_after_the_command() -> None:
    parser = build_parser()
    for argv in (
        ["--log-format", "json", "--log-level", "debug", "serve"],
        ["serve", "--log-format", "json", "--log-level", "debug"],
        ["demo", "--log-format", "json", "--log-level", "DEBUG"],
        ["--log-format", "json", "bench", "--log-level", "debug"],
    ):
        args = parser.parse_args(argv)
        assert (args.log_format, args.log_level) == ("json", "DEBUG"), argv
    args = parser.parse_args(["--log-format", "json", "replay", "x"])
    assert (args.log_format, args.log_level) == ("json", None)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-format", "xml"])


def test_main_puts_the_logger_back_after_a_command(tmp_path: Path) -> None:
    logger = logging.getLogger(ROOT)
    before = (logger.level, logger.propagate, list(logger.handlers))
    assert main(["--log-format", "json", "replay", str(tmp_path / "missing.p2plog")]) == 2
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


def test_every_logger_is_under_p2pactor() -> None:
    """Every getLogger call in the package names a logger under ``p2pactor.``, and no
    module logs through the root logger or configures it."""
    names: list[str] = []
    sources = [*(REPO / "p2pactor").rglob("*.py"), *(REPO / "adapters").rglob("*.py")]
    assert len(sources) > 20
    for path in sources:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            func = node.func
            if not (isinstance(func.value, ast.Name) and func.value.id == "logging"):
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            assert func.attr not in {"debug", "info", "warning", "error", "exception", "log"}, (
                f"{where} logs to the root logger"
            )
            assert func.attr != "basicConfig", f"{where} configures the root logger"
            if func.attr == "getLogger":
                (arg,) = node.args
                if isinstance(arg, ast.Name) and path.name == "logsetup.py":
                    assert arg.id == "ROOT", where
                    continue
                assert isinstance(arg, ast.Constant), where
                name = arg.value
                assert isinstance(name, str), where
                assert name.startswith(f"{ROOT}."), f"{where}: {name!r}"
                names.append(name)
    assert {
        "p2pactor.node",
        "p2pactor.session",
        "p2pactor.zmq",
        "p2pactor.nixl",
    } <= set(names)


# --- a real `p2pactor serve` process ---------------------------------------------------------


def read_line(process: subprocess.Popen[str], limit: float) -> str:
    """The next stdout line of ``process``, waiting at most ``limit`` seconds."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(limit):
            pytest.fail(f"no line on stdout within {limit:g} s")
    return process.stdout.readline()


def test_serve_with_json_logs_writes_only_json_to_stderr(tmp_path: Path) -> None:
    port = free_port()
    stranger = "127.0.0.1:2"  # not in --allowed-peers: its first frame is refused
    argv = [sys.executable, "-m", "p2pactor", "serve", "--log-format", "json"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--num-blocks", "8"]
    argv += ["--block-len", "64", "--preload", "2", "--allowed-peers", "127.0.0.1:1"]
    argv += ["--metrics-port", "0"]  # where to scrape is said on stderr: JSON too
    stderr_path = tmp_path / "serve.stderr"
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=child_env()
        )
    try:
        first = read_line(process, 60)
        assert first.startswith(f"p2pactor node 127.0.0.1:{port} serving"), (
            first + stderr_path.read_text()
        )
        context = zmq.Context()
        try:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, stranger.encode())
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealer.send(b"let me in")
            deadline = time.monotonic() + 30
            while "allowed_peers" not in stderr_path.read_text():
                assert time.monotonic() < deadline, stderr_path.read_text()
                time.sleep(0.05)
            dealer.close()
        finally:
            context.term()
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=30)
    finally:
        if process.returncode is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr_path.read_text()
    stdout = first + rest
    assert stdout.endswith(f"p2pactor node 127.0.0.1:{port} stopped\n")
    for line in stdout.splitlines():
        assert not line.startswith("{"), f"a log line on stdout: {line}"
    lines = json_lines(stderr_path.read_text())
    (refused,) = [line for line in lines if line.get("peer") == stranger]
    assert refused["logger"] == "p2pactor.zmq"
    assert refused["level"] == "WARNING"
    assert refused["node"] == f"127.0.0.1:{port}"
    assert "add it to allowed_peers (P2PACTOR_ALLOWED_PEERS)" in refused["message"]
    assert any(line["message"] == "stopping on signal 15" for line in lines)
    (metrics,) = [line for line in lines if line["message"].startswith("metrics: http://")]
    assert metrics["node"] == f"127.0.0.1:{port}"


def test_demo_passes_json_logging_to_its_node_processes(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "p2pactor", "demo", "--nodes", "2", "--requests", "2"]
    run = subprocess.run(
        [*argv, "--log-format", "json", "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Demo OK" in run.stdout
    for line in run.stdout.splitlines():
        assert not line.startswith("{"), f"a log line on stdout: {line}"
    ids = set()
    for index in (0, 1):
        lines = json_lines((tmp_path / f"node-{index}.stderr").read_text())
        ready = [line for line in lines if line["logger"] == "p2pactor.session"]
        assert ready, lines
        ids |= {(line["node"], line["peer"]) for line in ready}
    (a, b) = {node for node, _ in ids}
    assert ids == {(a, b), (b, a)}  # each node names itself and the other


def test_bench_json_to_stdout_keeps_tables_and_logs_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench --json -``: stdout is the JSON document alone (a fake section: no benchmark)."""

    class Section:
        NAME = "control"
        TITLE = "a section that only logs"

        @staticmethod
        def run(options: BenchOptions) -> SectionResult:
            logging.getLogger("p2pactor.session").info("session with x:1 ready")  # bench: hidden
            logging.getLogger("p2pactor.node").warning("refused x:1", extra=peer_context("x:1"))
            return SectionResult(name="control", title=Section.TITLE, rows=[{"n": 1}])

    monkeypatch.setattr(bench_cli, "_load", lambda name: Section)
    assert main(["bench", "--log-format", "json", "--json", "-", "--only", "control"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [s["name"] for s in report["sections"]] == ["control"]
    assert "a section that only logs" in err  # the table
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [(line["message"], line["peer"]) for line in logged] == [("refused x:1", "x:1")]


def test_an_unexpected_error_is_one_json_line_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: object) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(replay_cli, "run", broken)
    assert main(["--log-format", "json", "replay", "x.p2plog"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = json_lines(err)
    assert (line["level"], line["logger"]) == ("CRITICAL", "p2pactor.cli")
    assert "p2pactor replay stopped on an unexpected error" in line["message"]
    assert line["exc_info"].startswith("Traceback")
    assert line["exc_info"].endswith("RuntimeError: boom")
