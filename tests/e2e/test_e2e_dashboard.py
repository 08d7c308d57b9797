"""The dashboard in a real browser: headless Chromium, driven over the W3C WebDriver
protocol with urllib (no client library), against a coordinator training with workers.
Also checks that /metrics parses strictly and its counters move during the run.

``CLEAVE_WRITE_SCREENSHOTS=1`` saves the screenshot as docs/dashboard.png."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.exposition import parse_exposition
from support.procs import ROOT, Coordinator, Worker, wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
HOSTILE_NAME = "<img src=x onerror=\"document.title='owned'\">eve"
# The operator's own description may hold markup too (pasted from a web page): text.
DESCRIPTION = (
    "A small GPT learning Shakespeare's sonnets, one character at a time. "
    "Markup such as <b>this</b> or <img src=y onerror=alert(1)> shows as typed."
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
        reason="needs /usr/bin/chromium and /usr/bin/chromedriver "
        "(Debian: apt-get install chromium chromium-driver)",
    ),
]


class WebDriver:
    """The few W3C WebDriver commands this test needs, over plain HTTP."""

    def __init__(self, port: int, user_data_dir: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        capabilities = {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": str(CHROMIUM),
                "args": [
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--window-size=1280,1100",
                    f"--user-data-dir={user_data_dir}",
                ],
            },
        }
        reply = self._call("POST", "/session", {"capabilities": {"alwaysMatch": capabilities}})
        self.session = f"/session/{reply['sessionId']}"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)["value"]

    def get(self, url: str) -> None:
        self._call("POST", f"{self.session}/url", {"url": url})

    def script(self, source: str) -> Any:
        return self._call("POST", f"{self.session}/execute/sync", {"script": source, "args": []})

    def screenshot_png(self) -> bytes:
        return base64.b64decode(self._call("GET", f"{self.session}/screenshot"))

    def quit(self) -> None:
        self._call("DELETE", self.session)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "chromedriver.log").open("wb")
    driver = subprocess.Popen(
        [str(CHROMEDRIVER), f"--port={port}", "--allowed-ips=127.0.0.1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: _ready(port), 30, "chromedriver to listen")
        web = WebDriver(port, tmp_path / "chromium-profile")
        try:
            yield web
        finally:
            web.quit()
    finally:
        driver.terminate()
        try:
            driver.wait(10)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        log.close()


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as response:
            return bool(json.load(response)["value"]["ready"])
    except OSError:
        return False


PAGE_STATE = """
const rows = [...document.querySelectorAll('#workers tr')];
return {
  step: document.getElementById('step').textContent,
  state: document.getElementById('state').textContent,
  points: Number(document.getElementById('loss-chart').dataset.points),
  loss: document.getElementById('loss').textContent,
  verified: document.querySelector('[data-count="verified"]')?.textContent ?? '',
  workers: rows.map((r) => r.cells[0].firstChild?.textContent ?? ''),
  images: document.querySelectorAll('#workers img, #about-card img').length,
  about: document.getElementById('about-description').textContent,
  aboutMeta: document.getElementById('about-meta').textContent,
  flops: document.getElementById('flop-share').textContent,
  title: document.title,
};
"""


def _eventually(
    web: WebDriver, check: Callable[[dict[str, Any]], bool], timeout: float, what: str
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    page: dict[str, Any] = {}
    while time.monotonic() < deadline:
        page = web.script(PAGE_STATE)
        if check(page):
            return page
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; the page shows {page}")


def _step_shown(page: dict[str, Any]) -> int:
    text = page["step"].split("/")[0].replace(",", "").strip()
    return int(text) if text.isdigit() else -1


def _metrics(coord: Coordinator) -> Any:
    with urllib.request.urlopen(coord.http + "/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse_exposition(response.read().decode())


@pytest.mark.timeout(300)
def test_dashboard_shows_live_training_in_chromium(browser: WebDriver, tmp_path: Path) -> None:
    coord = Coordinator(
        tmp_path,
        *("--steps", "100000", "--local-workers", "2", "--checkpoint-every", "100000"),
        *("--job-description", DESCRIPTION, "--job-operator", "Lab 7"),
    )
    hostile: Worker | None = None
    try:
        wait_until(lambda: len(coord.steps()) >= 2, 150, "two steps")
        before = _metrics(coord)
        browser.get(coord.http + "/")
        page = _eventually(
            browser,
            lambda p: _step_shown(p) >= 2 and p["points"] >= 2 and len(p["workers"]) == 2,
            30,
            "steps, chart points and both workers",
        )
        assert sorted(page["workers"]) == ["local-0", "local-1"], page
        assert page["state"] == "training" and page["loss"] != "–", page
        assert page["about"] == DESCRIPTION and page["images"] == 0, page
        assert page["aboutMeta"].startswith("run by Lab 7 · "), page
        assert int(page["verified"].replace(",", "")) > 0, page
        assert re.match(r"Workers computed \d+\.\d% of the last step's [\d.]+ GFLOP", page["flops"])
        first_step, first_points = _step_shown(page), page["points"]
        write_screenshot = os.environ.get("CLEAVE_WRITE_SCREENSHOTS") == "1"
        # For the docs, a chart worth looking at; for CI, just proof that it moves.
        want_step = 30 if write_screenshot else first_step + 2
        page = _eventually(
            browser,
            lambda p: _step_shown(p) >= want_step and p["points"] > first_points,
            120,
            "the step to advance",
        )
        png = browser.screenshot_png()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
        (tmp_path / "dashboard.png").write_bytes(png)
        if write_screenshot:
            shutil.copyfile(tmp_path / "dashboard.png", ROOT / "docs" / "dashboard.png")

        after = _metrics(coord)
        for counter in ("cleave_tiles_sent_total", "cleave_tiles_verified_total"):
            assert after.value(counter) > before.value(counter), counter
        assert after.value("cleave_steps_total") > before.value("cleave_steps_total")
        assert after.value("cleave_bytes_down_total") > before.value("cleave_bytes_down_total")
        assert after.value("cleave_workers_connected") == 2
        assert 0 < after.value("cleave_step_workers_flop_share") <= 1
        assert after.value("cleave_step_gflop") > 0
        assert after.value("cleave_step_orchestration_cpu_seconds") > 0
        names = {dict(labels)["worker"] for labels in after.series("cleave_worker_in_flight")}
        assert names == {"local-0", "local-1"}

        # A stranger picks a name that is markup: the page shows it as text, runs nothing.
        hostile = Worker(tmp_path, coord.url, HOSTILE_NAME)
        page = _eventually(
            browser, lambda p: HOSTILE_NAME in p["workers"], 60, "the hostile worker's row"
        )
        assert page["images"] == 0 and page["title"] != "owned", page
        assert HOSTILE_NAME in {
            dict(labels)["worker"] for labels in _metrics(coord).series("cleave_worker_in_flight")
        }
    finally:
        if hostile is not None:
            hostile.stop()
        coord.stop()


RANKS_STATE = """
return {
  hidden: document.getElementById('ranks-card').hidden,
  sub: document.getElementById('ranks-sub').textContent,
  rows: [...document.querySelectorAll('#ranks tr')]
    .map((r) => [...r.cells].map((c) => c.textContent)),
};
"""


@pytest.mark.timeout(300)
def test_any_ranks_dashboard_shows_every_rank_in_chromium(
    browser: WebDriver, tmp_path: Path
) -> None:
    coord = Coordinator(
        tmp_path,
        *("--ranks", "2", "--steps", "100000", "--local-workers", "1"),
        *("--checkpoint-every", "100000"),
    )
    try:
        wait_until(lambda: len(coord.steps()) >= 1, 150, "a step of both ranks")
        urls = sorted(set(re.findall(r"on (ws://127\.0\.0\.1:\d+/ws)", coord.output())))
        assert len(urls) == 2, coord.output()
        browser.get(coord.http + "/")  # whichever rank printed its address first
        deadline = time.monotonic() + 60
        page: dict[str, Any] = {}
        while time.monotonic() < deadline:
            page = browser.script(RANKS_STATE)
            rows = page["rows"]
            if len(rows) == 2 and sorted(r[1] for r in rows) == urls and "2 workers" in page["sub"]:
                break
            time.sleep(0.25)
        else:
            raise AssertionError(f"the ranks table never showed both ranks: {page}")
        assert not page["hidden"] and page["sub"].startswith("This page is rank "), page
        assert [r[0].split()[0] for r in page["rows"]] == ["0", "1"], page
        assert sum("(this one)" in r[0] for r in page["rows"]) == 1, page
        assert all(r[2] == "training" and r[8].endswith("ago") for r in page["rows"]), page
    finally:
        coord.stop()
