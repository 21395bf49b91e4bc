"""The timeline dashboard in a real browser: headless Chromium driven by Playwright.

Playwright drives Debian's ``chromium`` package (``/usr/bin/chromium``, or the
path in ``P2PACTOR_CHROMIUM``); it never downloads a browser. ``.ci/run``
installs the package, and in CI (``CI`` set) a missing browser fails the test
instead of skipping it.

The page is read through its test hook, ``window.p2pactorDashboard`` (see
``p2pactor/surface/dashboard/README.md``), not by matching pixels. Screenshots go to
``build/screenshots/`` for people to look at; ``dashboard-timings.json`` there
has the page's load and redraw times.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "screenshots"
DEMO_REQUESTS = 3
DEMO_NODES = 2
SYNTHETIC_REQUESTS = 1000
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium() -> str | None:
    configured = os.environ.get("P2PACTOR_CHROMIUM")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for candidate in ("/usr/bin/chromium", shutil.which("chromium")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _require_browser() -> str:
    """The browser's path; skip (fail in CI) without it or without Playwright."""
    path = _chromium()
    missing = None
    if path is None:
        missing = "no Chromium: install Debian's chromium package (apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401, PLC0415
        except ImportError:
            missing = "Playwright is not installed (pip install -e '.[test]')"
    if missing is not None:
        pytest.skip(missing)  # a failure under CI=1 (conftest.py)
    assert path is not None
    return path


# --- processes -------------------------------------------------------------------


class Proc:
    """A p2pactor subprocess whose merged output is read line by line in a thread."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
        env["PYTHONUNBUFFERED"] = "1"
        self.args = args
        self.process = subprocess.Popen(
            [sys.executable, "-m", "p2pactor", *args],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line (so far or to come) that matches ``pattern``."""
        regex = re.compile(pattern)
        for line in self.lines:
            found = regex.search(line)
            if found:
                return found
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)  # keep the end visible to later waits
                break
            self.lines.append(line)
            found = regex.search(line)
            if found:
                return found
        pytest.fail(
            f"p2pactor {' '.join(self.args)} printed no line matching {pattern!r} "
            f"(exit status {self.process.poll()}); its output:\n{self.output()}"
        )

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit, collecting its output; its exit status."""
        try:
            status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"p2pactor {' '.join(self.args)} still running after {timeout:g} s; "
                f"its output:\n{self.output()}"
            )
        self._reader.join(timeout=10)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)
                break
            self.lines.append(line)
        return status

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()


# `p2pactor demo --dashboard` and `p2pactor replay --serve` print the page as
# "dashboard: URL".
URL = r"dashboard: (https?://\S+)"


# --- the browser -------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium for the module, with a fresh profile."""
    executable = _require_browser()
    from playwright.sync_api import sync_playwright  # noqa: PLC0415

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        # Playwright passes --user-data-dir itself for a persistent context.
        context = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1440, "height": 860},
        )
        try:
            yield context
        finally:
            context.close()


class Page:
    """A dashboard page and its test hook."""

    def __init__(self, context: Any) -> None:
        self.page = context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on(
            "console",
            lambda msg: self.errors.append(msg.text) if msg.type == "error" else None,
        )
        # Every URL the page asks for: it must work offline (no CDN, no fonts).
        self.requests: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))

    def foreign_requests(self) -> list[str]:
        """Requests the page made anywhere but the loopback server it came from."""
        return [
            url
            for url in self.requests
            if re.match(r"^(https?|wss?)://(127\.0\.0\.1|localhost)(:\d+)?/", url) is None
            and not url.startswith("data:")
        ]

    def open(self, url: str, timeout: float = 60) -> float:
        """Load the page and wait until every feed is connected and its snapshot is in.

        Returns the seconds from navigation to ready.
        """
        started = time.monotonic()
        self.page.goto(url)
        self.wait("() => window.p2pactorDashboard && window.p2pactorDashboard.ready()", timeout)
        return time.monotonic() - started

    def hook(self, expression: str, arg: Any = None) -> Any:
        """Evaluate ``expression`` with ``d`` bound to the hook (and ``arg``)."""
        return self.page.evaluate(
            f"(arg) => {{ const d = window.p2pactorDashboard; {expression} }}", arg
        )

    def wait(self, predicate: str, timeout: float, arg: Any = None) -> None:
        try:
            self.page.wait_for_function(predicate, arg=arg, timeout=timeout * 1000)
        except Exception as exc:
            state = self.page.evaluate(
                "() => window.p2pactorDashboard ? {feeds: window.p2pactorDashboard.feeds(), "
                "lanes: window.p2pactorDashboard.lanes().map(l => [l.request, l.consumerPhase, "
                "l.producerPhase, l.events])} : null"
            )
            pytest.fail(
                f"{predicate} never held: {exc}\npage state: {state}\nerrors: {self.errors}"
            )

    def lanes(self) -> dict[str, dict[str, Any]]:
        return {lane["request"]: lane for lane in self.hook("return d.lanes();")}

    def screenshot(self, name: str) -> Path:
        SHOTS.mkdir(parents=True, exist_ok=True)
        path = SHOTS / name
        self.page.screenshot(path=str(path))
        return path

    def close(self) -> None:
        self.page.close()


def _replayed_outcome(logs: list[str]) -> dict[str, dict[str, Any]]:
    """``p2pactor replay --json`` of ``logs``: each request's final phase per role."""
    done = subprocess.run(
        [sys.executable, "-m", "p2pactor", "replay", "--json", *logs],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(done.stdout)
    outcome: dict[str, dict[str, Any]] = {}
    for actor in report["actors"]:
        entry = outcome.setdefault(actor["kv_request_id"], {"events": 0})
        entry[actor["role"]] = actor["phase"]
        entry["events"] += actor["events"]
    return outcome


def _demo_requests() -> list[str]:
    from p2pactor.programs.demo.workload import DemoPlan, requests_of  # noqa: PLC0415

    plan = DemoPlan(nodes=DEMO_NODES, requests=DEMO_REQUESTS, block_len=4096)
    return [r.kv_request_id for r in requests_of(plan)]


ALL_FINAL = (
    # A page predicate: a lane per request id in the argument, each in a final phase on
    # both sides.
    "(ids) => { const d = window.p2pactorDashboard; if (!d) return false;"
    " const lanes = new Map(d.lanes().map(l => [l.request, l]));"
    " return ids.every(id => { const l = lanes.get(id);"
    " return l && ['done', 'failed', 'aborted'].includes(l.consumerPhase)"
    " && l.producerPhase === 'closed'; }); }"
)


def _write_timings(section: str, values: dict[str, Any]) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / "dashboard-timings.json"
    try:
        timings = json.loads(path.read_text())
    except (OSError, ValueError):
        timings = {}
    timings[section] = values
    path.write_text(json.dumps(timings, indent=2) + "\n")
    print(f"dashboard timings ({section}): {json.dumps(values)}")


def _hover_first_mark(page: Page, request: str) -> str:
    """Hover the first mark of the request's consumer; the tooltip's text."""
    page.hook("d.scrollToLane(arg); return null;", request)
    point = page.hook("return d.eventPoint(arg, 'consumer', 0);", request)
    assert point is not None, f"no consumer mark of {request} on screen"
    page.page.mouse.move(point["x"], point["y"])
    tooltip = page.page.locator("#tooltip")
    tooltip.wait_for(state="visible", timeout=5000)
    return tooltip.inner_text()


def _hover_lane_label(page: Page, request: str) -> str:
    """Hover the request's name in the label column; the tooltip's text."""
    page.hook("d.scrollToLane(arg); return null;", request)
    point = page.hook("return d.eventPoint(arg, 'consumer', 0);", request)
    assert point is not None, f"the lane of {request} is not on screen"
    box = page.page.locator("#scroller").bounding_box()
    assert box is not None
    page.page.mouse.move(box["x"] + 40, point["y"])  # over the request id, left of the rows
    tooltip = page.page.locator("#tooltip")
    tooltip.wait_for(state="visible", timeout=5000)
    return tooltip.inner_text()


# --- the demo, live ------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_run(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``p2pactor demo --dashboard``, watched live in the page; what it showed and wrote.

    The page is opened as soon as the demo prints its URL (before the requests
    run), and read once every request's lane is final on both sides. The demo
    lingers with its dashboards up until told to stop (SIGTERM), then checks
    its logs and prints its verdict.
    """
    log_dir = tmp_path_factory.mktemp("demo-logs")
    demo = Proc(
        [
            "demo",
            "--dashboard",
            "0",  # free ports, picked by the nodes: no race with other programs
            "--nodes",
            str(DEMO_NODES),
            "--requests",
            str(DEMO_REQUESTS),
            "--block-size",
            "4096",
            "--linger",
            "60",
            "--log-dir",
            str(log_dir),
        ],
        ROOT,
    )
    page = Page(browser)
    try:
        # The demo prints one URL that gives the page every node's feed.
        url = demo.wait_for_line(URL, timeout=90).group(1).rstrip(".,;)")
        assert url.startswith("http://127.0.0.1:"), url
        load_s = page.open(url)
        seen_early = page.hook("return d.lanes().length;")
        expected = _demo_requests()
        page.wait(ALL_FINAL, timeout=90, arg=expected)
        lanes = page.lanes()
        feeds = page.hook("return d.feeds();")
        mode = page.hook("return d.mode();")
        connected = page.hook("return d.connected();")
        security = page.hook("return d.security();")
        badge = page.hook("return d.securityBadge();")
        # Wait for a counters report that has seen every request's lookup.
        page.wait(
            "(n) => { const c = window.p2pactorDashboard.counters();"
            " return c.source === 'node' && c.lookups >= n; }",
            timeout=30,
            arg=len(expected),
        )
        counters = page.hook("return d.counters();")
        peers = page.hook("return d.peers();")
        tooltip = _hover_first_mark(page, expected[0])
        page.page.mouse.move(5, 5)
        lane_tooltip = _hover_lane_label(page, expected[0])
        page.page.mouse.move(5, 5)
        page.hook("d.follow(); return null;")
        auto_badges = page.hook("return d.autoBadges();")
        page.hook("d.select(arg); return null;", expected[-1])
        details = page.page.locator("#details").inner_text()
        shot = page.screenshot("dashboard-live.png")
        # The filter box: typing a request id leaves its lane alone.
        page.page.fill("#filter", expected[1])
        filtered = page.hook("return d.visibleLanes();")
        page.page.fill("#filter", "")
        unfiltered = page.hook("return d.visibleLanes();")
        # The Pause button freezes the view; pressing it again follows the feed.
        page.page.click("#pause")
        paused = page.hook("return d.paused();")
        page.page.click("#pause")
        resumed = not page.hook("return d.paused();")
        _write_timings("live demo", {"page_ready_s": round(load_s, 3)})
        demo.wait_for_line(r"dashboard stays up", timeout=60)
        demo.process.terminate()  # ends the linger: the demo stops its nodes and checks
        status = demo.wait(timeout=120)
        yield {
            "url": url,
            "lanes": lanes,
            "expected": expected,
            "seen_early": seen_early,
            "feeds": feeds,
            "mode": mode,
            "connected": connected,
            "security": security,
            "badge": badge,
            "counters": counters,
            "peers": peers,
            "tooltip": tooltip,
            "lane_tooltip": lane_tooltip,
            "auto_badges": auto_badges,
            "details": details,
            "filtered": filtered,
            "unfiltered": unfiltered,
            "paused": paused,
            "resumed": resumed,
            "foreign": page.foreign_requests(),
            "status": status,
            "output": demo.output(),
            "log_dir": log_dir,
            "screenshot": shot,
            "errors": list(page.errors),
        }
    finally:
        page.close()
        demo.stop()


def _demo_logs(demo_run: dict[str, Any]) -> list[str]:
    """The event logs the demo says it wrote."""
    logs_line = re.search(r"Event logs: (.+?)\s+\(", demo_run["output"])
    assert logs_line is not None, demo_run["output"]
    log_dir = Path(logs_line.group(1))
    assert log_dir == demo_run["log_dir"]
    logs = sorted(str(p) for p in log_dir.glob("node-*.p2plog"))
    assert len(logs) == DEMO_NODES, logs
    return logs


def test_live_demo_shows_a_lane_per_request(demo_run: dict[str, Any]) -> None:
    assert demo_run["mode"] == "live"
    assert demo_run["connected"]
    feeds = demo_run["feeds"]
    assert len(feeds) == DEMO_NODES, feeds  # one feed per node, merged
    assert all(f["state"] == "open" and f["mode"] == "live" for f in feeds), feeds
    assert sorted(demo_run["lanes"]) == sorted(demo_run["expected"])
    for lane in demo_run["lanes"].values():
        roles = sorted(a["role"] for a in lane["actors"])
        assert roles == ["consumer", "producer"], lane  # the two sides, from two nodes
        nodes = {a["node"] for a in lane["actors"]}
        assert len(nodes) == 2, lane
    # Hovering a mark shows the event's details.
    assert "actor" in demo_run["tooltip"]
    assert "seq" in demo_run["tooltip"]
    # Peers panel: every node reports its peer, connected.
    peers = demo_run["peers"]
    assert len(peers) == DEMO_NODES, peers
    for node, entries in peers.items():
        assert [p["state"] for p in entries] == ["ready"], (node, entries)
    assert demo_run["filtered"] == [demo_run["expected"][1]]
    assert sorted(demo_run["unfiltered"]) == sorted(demo_run["expected"])
    assert demo_run["paused"]
    assert demo_run["resumed"]
    assert not demo_run["foreign"], demo_run["foreign"]  # works offline
    assert demo_run["screenshot"].stat().st_size > 10_000
    assert not demo_run["errors"], demo_run["errors"]


def test_live_page_marks_the_requests_whose_peer_the_node_chose(demo_run: dict[str, Any]) -> None:
    # The demo's requests name no source (DemoPlan(named=False)): each node chose
    # the peer from the summaries, and each lane says so, with that peer.
    lanes = demo_run["lanes"]
    for request, lane in lanes.items():
        source = lane["source"]
        assert source is not None, lane
        [consumer] = [a for a in lane["actors"] if a["role"] == "consumer"]
        [producer] = [a for a in lane["actors"] if a["role"] == "producer"]
        assert source["chosen"] == consumer["peer"] == producer["node"], (request, lane)
        assert source["claims"][0]["peer"] == source["chosen"], source
        assert source["claims"][0]["run"] > 0, source
        assert source["reason"].startswith("longest worthwhile run"), source
    # Every lane on screen was drawn with its badge (the demo's few all fit).
    assert sorted(demo_run["auto_badges"]) == sorted(lanes)
    # Hovering the request's name: the badge, the chosen peer, the claims, why.
    first = lanes[demo_run["expected"][0]]["source"]
    tip = demo_run["lane_tooltip"]
    assert "auto" in tip
    assert f"source auto {first['chosen']}" in " ".join(tip.split()), tip
    for claim in first["claims"]:
        assert f"{claim['peer']}: {claim['run']}" in tip, tip
    assert first["reason"] in tip
    # The selected lane's panel names its peer too.
    last = lanes[demo_run["expected"][-1]]["source"]
    assert f"source {last['chosen']}" in demo_run["details"], demo_run["details"]
    assert "auto" in demo_run["details"]


def test_live_page_shows_the_control_channels_security(demo_run: dict[str, Any]) -> None:
    # The demo's nodes run without CURVE keys: their hello says "none" and the page
    # says so in its top bar.
    security = demo_run["security"]
    assert len(security) == DEMO_NODES, f"the feed's hello gave no security per node: {security}"
    assert set(security.values()) == {"none"}, security
    assert demo_run["badge"] is not None
    assert "unauthenticated control channel" in demo_run["badge"]


def test_curve_demo_shows_an_authenticated_control_channel(browser: Any, tmp_path: Path) -> None:
    # With --curve every node's hello says "curve": no warning, a quiet CURVE badge.
    demo = Proc(
        [
            "demo",
            "--curve",
            "--dashboard",
            "0",
            "--nodes",
            str(DEMO_NODES),
            "--requests",
            "1",
            "--block-size",
            "4096",
            "--linger",
            "60",
            "--log-dir",
            str(tmp_path),
        ],
        ROOT,
    )
    page = Page(browser)
    try:
        url = demo.wait_for_line(URL, timeout=90).group(1).rstrip(".,;)")
        page.open(url)
        # The badge is drawn at the next frame after the hellos: wait for it.
        page.wait("() => window.p2pactorDashboard.securityBadge() !== null", timeout=30)
        security = page.hook("return d.security();")
        badge = page.hook("return d.securityBadge();")
        page.screenshot("dashboard-curve.png")
        assert len(security) == DEMO_NODES, security
        assert set(security.values()) == {"curve"}, security
        assert badge is not None
        assert "CURVE" in badge
        assert "unauthenticated" not in badge
        assert not page.errors, page.errors
        demo.wait_for_line(r"dashboard stays up", timeout=60)
        demo.process.terminate()
        assert demo.wait(timeout=120) == 0, demo.output()
    finally:
        page.close()
        demo.stop()


def test_live_phases_match_the_demo_outcome(demo_run: dict[str, Any]) -> None:
    output = demo_run["output"]
    assert demo_run["status"] == 0, output
    assert "Demo OK" in output, output
    # The demo's summary: requests, keys, hits, misses ... failures (the last column).
    total = re.search(r"^total\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+).*?(\d+)\s*$", output, re.M)
    assert total is not None, output
    requests, hits, failures = int(total.group(1)), int(total.group(3)), int(total.group(5))
    assert requests == len(demo_run["expected"])
    assert failures == 0
    # Every request verified, so every consumer ended done and every producer closed.
    phases = {(lane["consumerPhase"], lane["producerPhase"]) for lane in demo_run["lanes"].values()}
    assert phases == {("done", "closed")}, demo_run["lanes"]
    # And request by request, the page agrees with the logs the demo wrote.
    outcome = _replayed_outcome(_demo_logs(demo_run))
    assert sorted(outcome) == sorted(demo_run["expected"])
    for request, lane in demo_run["lanes"].items():
        assert lane["consumerPhase"] == outcome[request]["consumer"], (request, lane)
        assert lane["producerPhase"] == outcome[request]["producer"], (request, lane)
    # The counters: the nodes' reports match the demo's summary.
    counters = demo_run["counters"]
    assert counters["lookups"] >= requests, counters
    assert counters["keys_hit"] == hits, (counters, total.group(0))
    assert counters["failures"] == 0, counters


# --- the demo's logs, replayed --------------------------------------------------------


def test_replay_serves_the_demo_logs(browser: Any, demo_run: dict[str, Any]) -> None:
    logs = _demo_logs(demo_run)
    outcome = _replayed_outcome(logs)
    server = Proc(["replay", *logs, "--serve", "0"], ROOT)
    page = Page(browser)
    try:
        found = server.wait_for_line(URL, timeout=60)
        url = found.group(1).rstrip(".,;)")
        assert url.startswith("http://127.0.0.1:"), url
        load_s = page.open(url)
        assert page.hook("return d.mode();") == "replay"
        expected = demo_run["expected"]
        start = page.hook("return d.replayStart();")
        end = page.hook("return d.replayEnd();")
        assert start is not None
        assert end is not None
        assert end > start
        slider = page.page.locator("#slider")
        assert slider.is_visible()

        # The slider at the end: the demo's outcome, as live and as the logs say.
        slider.focus()
        slider.press("End")
        assert page.hook("return d.time();") == pytest.approx(end, abs=1e-6)
        lanes = page.lanes()
        assert sorted(lanes) == sorted(expected)
        for request, lane in lanes.items():
            assert lane["consumerPhase"] == outcome[request]["consumer"], (request, lane)
            assert lane["producerPhase"] == outcome[request]["producer"], (request, lane)
            assert lane["events"] == outcome[request]["events"], (request, lane)
        counters = page.hook("return d.counters();")
        assert counters["lookups"] >= len(expected), counters
        assert counters["failures"] == 0, counters
        page.screenshot("dashboard-replay-end.png")

        # The slider at the start: only the first request(s), in their first phase.
        slider.press("Home")
        assert page.hook("return d.time();") == pytest.approx(start, abs=1e-6)
        at_start = page.lanes()
        assert 1 <= len(at_start) < len(expected), at_start
        assert page.hook("return d.visibleLanes().length;") == len(at_start)
        for lane in at_start.values():
            assert lane["consumerPhase"] not in ("done", "failed", "aborted"), lane
            assert lane["events"] < outcome[lane["request"]]["events"], lane

        # In the middle of the longest request: an earlier phase on at least one side.
        longest = max(lanes.values(), key=lambda x: x["end"] - x["start"])
        middle = (longest["start"] + longest["end"]) / 2
        page.hook("return d.setTime(arg);", middle)
        earlier = page.lanes()[longest["request"]]
        assert (earlier["consumerPhase"], earlier["producerPhase"]) != ("done", "closed"), earlier
        assert earlier["events"] < longest["events"]

        # Dragging the slider with the mouse scrubs too: to its right end, all final.
        box = slider.bounding_box()
        assert box is not None
        page.page.mouse.click(box["x"] + box["width"] - 1, box["y"] + box["height"] / 2)
        page.wait(ALL_FINAL, timeout=10, arg=expected)

        # The picture: the middle of the run, the longest request selected.
        page.hook("d.setTime(arg[0]); d.select(arg[1]); return null;", [middle, longest["request"]])
        page.screenshot("dashboard-replay.png")
        _write_timings("replay demo", {"page_ready_s": round(load_s, 3)})
        assert not page.errors, page.errors
        assert not page.foreign_requests(), page.foreign_requests()
    finally:
        page.close()
        server.stop()


# --- 1,000 requests ----------------------------------------------------------------------


def _write_synthetic_logs(folder: Path, requests: int) -> list[Path]:
    """Two in-memory nodes run ``requests`` lookups and fetches between them, on a
    mock clock (the run spans about requests/20 virtual seconds, each request a
    second or so), and write their logs."""
    import hashlib  # noqa: PLC0415

    import trio  # noqa: PLC0415
    import trio.testing  # noqa: PLC0415

    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.log import Durability, EventLog  # noqa: PLC0415
    from p2pactor.runtime.node import open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.testing import MemoryDataPlane, MemoryNetwork  # noqa: PLC0415

    block_len = 64

    def key(i: int) -> bytes:
        return hashlib.sha256(f"block {i}".encode()).digest() + b"\x00\x00\x00\x00"

    paths = [folder / f"node-{i}.p2plog" for i in range(2)]

    async def run() -> None:
        network, plane = MemoryNetwork(), MemoryDataPlane()
        configs = [
            NodeConfig(host=f"10.0.0.{i + 1}", port=5710, num_blocks=512, block_len=block_len)
            for i in range(2)
        ]
        caches = [EmbeddedCache(c.num_blocks, c.block_len) for c in configs]
        for i in range(64):
            caches[i % 2].store(key(i), hashlib.sha256(key(i)).digest() * (block_len // 32))
        origin = (time.time(), trio.current_time())
        logs = [
            EventLog(c.node_id, path=p, clock_origin=origin, durability=Durability.on_close())
            for c, p in zip(configs, paths, strict=True)
        ]
        async with (
            open_node(
                configs[0],
                control=network.transport(configs[0].node_id),
                data=plane.transport(caches[0].memory, block_len),
                parent=caches[0],
                event_log=logs[0],
            ) as a,
            open_node(
                configs[1],
                control=network.transport(configs[1].node_id),
                data=plane.transport(caches[1].memory, block_len),
                parent=caches[1],
                event_log=logs[1],
            ) as b,
        ):
            nodes = [a, b]
            limiter = trio.CapacityLimiter(64)

            async def one(r: int) -> None:
                async with limiter:
                    me, other = r % 2, 1 - r % 2
                    node, cache = nodes[me], caches[me]
                    request = f"syn-{r:04d}"
                    keys = [key(2 * j + other) for j in range(r % 5, r % 5 + 4)]
                    keys.append(key(10_000 + r))  # nobody holds it: a miss
                    answers = await node.lookup(nodes[other].node_id, request, keys)
                    # Virtual time between the phases, so that each shows as a bar.
                    await trio.sleep(0.2 + (r % 7) * 0.15)
                    hits = [k for k, x in zip(keys, answers, strict=True) if x is LookupResult.HIT]
                    blocks = cache.allocate(len(hits))
                    await node.fetch(nodes[other].node_id, request, hits, blocks)
                    cache.free(blocks)
                    await trio.sleep(0.1 + (r % 3) * 0.1)
                    node.finish(request)

            async with trio.open_nursery() as nursery:
                for r in range(requests):
                    nursery.start_soon(one, r)
                    await trio.sleep(0.05)
            await trio.sleep(1)
        for log in logs:
            log.close()

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    return paths


def test_a_thousand_requests_stay_responsive(browser: Any, tmp_path: Path) -> None:
    """1,000 requests on screen: the page loads them and redraws only what shows.

    The timings (redraw, scroll, scrub, filter) go to dashboard-timings.json for
    people to read; they are not asserted (CI machines are small and shared).
    """
    logs = _write_synthetic_logs(tmp_path, SYNTHETIC_REQUESTS)
    server = Proc(["replay", *map(str, logs), "--serve", "0"], ROOT)
    page = Page(browser)
    try:
        url = server.wait_for_line(URL, timeout=60).group(1).rstrip(".,;)")
        load_s = page.open(url, timeout=120)
        page.hook("d.setTime(d.replayEnd()); return null;")
        lanes = page.lanes()
        assert len(lanes) == SYNTHETIC_REQUESTS
        assert {(x["consumerPhase"], x["producerPhase"]) for x in lanes.values()} == {
            ("done", "closed")
        }
        measured = page.hook(
            """
            const redraw = [];
            for (let i = 0; i < 10; i++) redraw.push(d.redraw());
            const height = d.scrollHeight();
            const scroll = [];
            for (let i = 0; i <= 40; i++) scroll.push(d.scrollTo((height * i) / 40).ms);
            const t0 = performance.now();
            const lanes = d.lanes().length;
            const lanesMs = performance.now() - t0;
            const s0 = performance.now();
            const a = d.replayStart(), b = d.replayEnd();
            for (let i = 0; i <= 20; i++) d.setTime(a + ((b - a) * i) / 20);
            const scrubMs = (performance.now() - s0) / 21;
            const f0 = performance.now();
            const matched = d.setFilter('syn-09');
            const filterMs = performance.now() - f0;
            d.setFilter('');
            const stats = d.stats();
            return {redraw, scroll, lanes, lanesMs, scrubMs, matched, filterMs, stats};
            """
        )
        assert measured["lanes"] == SYNTHETIC_REQUESTS
        assert measured["matched"] == 100  # syn-0900 .. syn-0999
        # Only visible rows are drawn: a screenful, not a thousand.
        assert 0 < measured["stats"]["visibleLanes"] < 100
        redraw = sorted(measured["redraw"])
        scroll = sorted(measured["scroll"])
        timings = {
            "requests": SYNTHETIC_REQUESTS,
            "events": measured["stats"]["events"],
            "page_ready_s": round(load_s, 3),
            "redraw_ms_median": redraw[len(redraw) // 2],
            "redraw_ms_max": redraw[-1],
            "scroll_ms_median": scroll[len(scroll) // 2],
            "scroll_ms_max": scroll[-1],
            "scrub_ms_mean": round(measured["scrubMs"], 2),
            "filter_ms": measured["filterMs"],
            "lanes_hook_ms": measured["lanesMs"],
            "visible_lanes": measured["stats"]["visibleLanes"],
        }
        _write_timings("1000 requests", timings)
        # The picture: the middle of the run through a 10 s window, following the
        # requests started by then.
        page.hook(
            "d.setTime((d.replayStart() + d.replayEnd()) / 2); d.setZoom(10); d.follow();"
            " return null;"
        )
        page.screenshot("dashboard-1000.png")
        assert not page.errors, page.errors
    finally:
        page.close()
        server.stop()
