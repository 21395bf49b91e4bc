"""docs/deploy.md and its Kubernetes manifests name only things that exist."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from p2pactor.programs.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "deploy.md"
MANIFESTS = [
    ROOT / "docs" / "deploy" / "statefulset.yaml",
    ROOT / "docs" / "deploy" / "statefulset-curve.yaml",
]
CONTROL_PORT = 5710
METRICS_PORT = 9464
HTTP_PORT = 8000


def load(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) >= {"Service", "StatefulSet"}, path
    return by_kind["Service"], by_kind["StatefulSet"]


def container(sts: dict[str, Any]) -> dict[str, Any]:
    containers = sts["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c["env"]}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_service_and_statefulset(path: Path) -> None:
    service, sts = load(path)
    assert service["spec"]["clusterIP"] == "None"
    assert CONTROL_PORT in {p["port"] for p in service["spec"]["ports"]}
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    c = container(sts)
    env = env_of(c)
    assert env["P2PACTOR_BIND_HOST"]["value"] == "0.0.0.0"
    assert env["VLLM_P2P_SIDE_CHANNEL_PORT"]["value"] == str(CONTROL_PORT)
    assert env["P2PACTOR_METRICS_PORT"]["value"] == str(METRICS_PORT)
    assert env["P2PACTOR_METRICS_HOST"]["value"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": HTTP_PORT, "p2p-control": CONTROL_PORT, "p2p-metrics": METRICS_PORT}
    argv = c["command"]
    assert argv[:2] == ["vllm", "serve"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (tier,) = extra["secondary_tiers"]
    assert tier["type"] == "P2PActorTierManager"
    assert tier["module_path"] == "p2pactor.adapters.vllm"
    assert tier["port"] == CONTROL_PORT
    assert "host" not in tier  # from VLLM_P2P_SIDE_CHANNEL_HOST, per pod
    assert argv[argv.index("--port") + 1] == str(HTTP_PORT)


def test_plain_manifest_advertises_the_pod_ip() -> None:
    _, sts = load(MANIFESTS[0])
    env = env_of(container(sts))
    assert env["VLLM_P2P_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert not any(name.startswith("P2PACTOR_CURVE") for name in env)


def test_curve_manifest_uses_dns_names_and_separate_key_volumes() -> None:
    service, sts = load(MANIFESTS[1])
    c = container(sts)
    env = env_of(c)
    fields = {
        n: e["valueFrom"]["fieldRef"]["fieldPath"] for n, e in env.items() if "valueFrom" in e
    }
    assert fields == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    name = service["metadata"]["name"]
    host = env["VLLM_P2P_SIDE_CHANNEL_HOST"]["value"]
    assert host == f"$(POD_NAME).{name}.$(POD_NAMESPACE).svc.cluster.local"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secret_key = env["P2PACTOR_CURVE_SECRET_KEY"]["value"]
    trusted = env["P2PACTOR_CURVE_TRUSTED"]["value"]
    assert secret_key == f"{mounts['curve-secret']}/$(POD_NAME).key_secret"
    assert trusted == mounts["curve-trusted"] != mounts["curve-secret"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["curve-secret"]["secret"]["defaultMode"] == 0o400
    assert "configMap" in volumes["curve-trusted"]
    text = MANIFESTS[1].read_text()
    guide = GUIDE.read_text()
    for thing in (
        volumes["curve-secret"]["secret"]["secretName"],
        volumes["curve-trusted"]["configMap"]["name"],
    ):
        assert thing in text.split("apiVersion", 1)[0]  # the comment says how to make it
        assert thing in guide


def test_guide_links_its_files() -> None:
    guide = GUIDE.read_text()
    for target in re.findall(r"\]\((deploy/[^)]+)\)", guide):
        assert (GUIDE.parent / target).is_file(), target
    assert "## Bind and advertise" in guide
    for path in [*MANIFESTS, ROOT / "docs" / "deploy" / "fetch.py"]:
        assert f"docs/{path.relative_to(ROOT / 'docs')}" in guide or path.name in guide


# --- every variable and flag the guide names exists -----------------------------------

OWN_VARIABLE = re.compile(r"\b((?:VLLM_P2P|P2PACTOR)_[A-Z0-9_]*[A-Z0-9])\b")
WILDCARD = {"P2PACTOR_QUOTA", "P2PACTOR_DASHBOARD", "P2PACTOR_CURVE"}  # families, "X_*"


def source_text() -> str:
    files = [*(ROOT / "p2pactor").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]
    return "\n".join(p.read_text() for p in files)


def test_every_variable_in_the_guide_and_manifests_is_read_by_the_code() -> None:
    text = GUIDE.read_text() + "".join(p.read_text() for p in MANIFESTS)
    named = set(OWN_VARIABLE.findall(text)) - WILDCARD
    assert len(named) >= 8, sorted(named)
    source = source_text()
    missing = sorted(v for v in named if not re.search(rf"\b{v}\b", source))
    assert not missing, f"docs/deploy.md names variables no code reads: {missing}"


def code_spans(markdown: str) -> list[str]:
    """Fenced blocks (continuation lines joined) and inline code spans."""
    spans = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", markdown, flags=re.S):
        spans.extend(block.replace("\\\n", " ").splitlines())
    without_blocks = re.sub(r"```.*?```", "", markdown, flags=re.S)
    spans.extend(re.findall(r"`([^`\n]+)`", without_blocks.replace("\n", " ")))
    return spans


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def commands_in(spans: list[str], program: str) -> list[tuple[str, list[str]]]:
    """(subcommand, its --flags) for every ``PROGRAM SUB ...`` in the spans."""
    found = []
    for span in spans:
        for m in re.finditer(rf"(?:^|[\s/]){re.escape(program)} ([a-z]+)([^;&|#]*)", span):
            if m.group(1) == "node" and re.match(r" \S+:\d+ ", m.group(2)):
                continue  # what `p2pactor serve` prints, quoted
            found.append((m.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", m.group(2))))
    return found


def test_every_p2pactor_subcommand_and_flag_in_the_guide_exists() -> None:
    parser = build_parser()
    subs = subparsers(parser)
    found = commands_in(code_spans(GUIDE.read_text()), "p2pactor")
    used = {sub for sub, _ in found}
    flags = [(sub, f) for sub, fs in found for f in fs]
    assert used >= {"serve", "keygen", "status"}, used
    assert len(flags) >= 8, flags
    for sub, flag in flags:
        assert sub in subs, f"p2pactor {sub}: no such subcommand"
        assert flag in options(subs[sub]) | options(parser), f"p2pactor {sub} has no {flag}"


def test_every_scripts_hosts_command_and_fetch_flag_exists() -> None:
    spans = code_spans(GUIDE.read_text())
    hosts_source = (ROOT / "p2pactor" / "programs" / "hosts.py").read_text()
    hosts_commands = set(re.findall(r'sub\.add_parser\("([a-z]+)"', hosts_source))
    used = {sub for sub, _ in commands_in(spans, "scripts/hosts")}
    assert used >= {"up", "exec", "down"}, used
    assert used <= hosts_commands, used - hosts_commands
    fetch_source = (ROOT / "docs" / "deploy" / "fetch.py").read_text()
    fetch_flags = set(re.findall(r'add_argument\("(--[a-z-]+)"', fetch_source))
    used_flags = {
        f
        for s in spans
        if "fetch.py" in s
        for f in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", s.split("fetch.py", 1)[1])
    }
    assert "--host" in used_flags
    assert used_flags <= fetch_flags, used_flags - fetch_flags
