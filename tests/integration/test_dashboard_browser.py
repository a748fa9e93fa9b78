"""The live dashboard in a real browser (Debian's headless Chromium) against a real local cluster.

A syncer, an evaluator and two learners run as processes; the dashboard serves from this test
process on 127.0.0.1:0. Chromium loads the page twice some seconds apart (--dump-dom: the DOM
after the page's script has fetched and rendered the state), then takes a screenshot. With
DDILOCO_UPDATE_SCREENSHOT=1 the screenshot is also copied to docs/dashboard.png (the README's).
The browser comes from scripts/browser_env.sh (apt-get if missing, through tests/browser.py, shared with
the container tier's Prometheus screenshot); no browser fails the test.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil

import pytest

from ddiloco.dashboard import Dashboard
from tests import browser
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def chromium() -> str:
    return browser.chromium()  # fails the test when there is no browser


def _browser(chromium: str, profile: pathlib.Path, *args: str, timeout_s: float = 120.0) -> str:
    """Runs headless Chromium once (tests/browser.py: own session, killed on timeout)."""
    return browser.run(profile, *args, timeout_s=timeout_s)


def _tag(dom: str, element_id: str) -> str:
    match = re.search(rf'<[a-z]+\b[^>]*\bid="{element_id}"[^>]*>', dom)
    assert match, f"no element #{element_id} in the page"
    return match.group(0)


def _attr(dom: str, element_id: str, name: str) -> str:
    match = re.search(rf'\b{name}="([^"]*)"', _tag(dom, element_id))
    assert match, f"#{element_id} has no {name}: {_tag(dom, element_id)}"
    return match.group(1)


def _element(dom: str, element_id: str, tag: str) -> str:
    """The outer HTML of the element (no nesting of the same tag inside it)."""
    match = re.search(rf'<{tag}\b[^>]*\bid="{element_id}".*?</{tag}>', dom, re.S)
    assert match, f"no <{tag} id={element_id}>"
    return match.group(0)


def test_dashboard_in_a_browser(cluster, chromium, tmp_path):
    cluster.env.setdefault("DDILOCO_INSECURE", "1")  # a local plaintext run on 127.0.0.1
    syncer = cluster.start_syncer(run_id="dashboard-browser", extra=TINY)
    cluster.start_evaluator(extra=["--interval-s", "3", "--num-shards", "2", "--eval-batches", "4"])
    for i in range(2):
        cluster.start_learner(i, region=f"region-{'ab'[i]}",
                              extra=["--steps", "0", "--num-shards", "2", *LEARNER_PACE])
    probe = SyncerProbe(syncer.address)
    dashboard = Dashboard(syncer.address, bind="127.0.0.1:0", interval_s=0.5)
    url = dashboard.start()
    profile = tmp_path / "chromium-profile"
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url), url
        wait_until(lambda: (s := probe.state(0)) and len(s.members) == 2
                   and all(m.uploads_accepted > 0 for m in s.members) and len(s.evals) >= 2,
                   timeout_s=300, what="both learners contributing and two held-out evaluations")

        first = _browser(chromium, profile, "--dump-dom", url)
        assert "live" in _element(first, "conn", "div")
        learners = _element(first, "learners", "table")
        assert 'data-learner="learner-0"' in learners and 'data-learner="learner-1"' in learners
        assert "region-a" in learners and "region-b" in learners and "active" in learners
        steps_1 = int(_attr(first, "outer-steps", "data-value"))
        assert steps_1 > 0 and re.search(r'id="run-id"[^>]*>dashboard-browser<', first)
        for plot_id in ("plot-heldout", "plot-work-merged", "plot-bandwidth", "plot-inner"):
            assert int(_attr(first, plot_id, "data-points")) >= 1, plot_id
            assert "<polyline" in _element(first, plot_id, "svg"), f"{plot_id} draws no line"
        work_merged = float(_attr(first, "work-merged", "data-value"))
        assert 0.0 < work_merged <= 1.5, work_merged  # a share, printed as a percentage
        assert float(_attr(first, "heldout-loss", "data-value")) > 0
        assert all(f'data-fragment="{f}"' in _element(first, "fragments", "table") for f in range(4))
        assert "learner-" in _element(first, "merges", "table")

        # Some seconds later the same page shows a newer state.
        wait_until(lambda: probe.state(0).outer_steps >= steps_1 + 4, timeout_s=120, what="more merges")
        second = _browser(chromium, profile, "--dump-dom", url)
        steps_2 = int(_attr(second, "outer-steps", "data-value"))
        assert steps_2 > steps_1, (steps_1, steps_2)
        assert int(_attr(second, "plot-work-merged", "data-points")) > int(_attr(first, "plot-work-merged", "data-points"))

        shot = tmp_path / "dashboard.png"
        _browser(chromium, profile, f"--screenshot={shot}", "--window-size=1400,1000", url)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        if os.environ.get("DDILOCO_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")

        # The syncer goes away (after the learners, which would otherwise keep retrying it until they
        # are stopped): the page says so instead of failing.
        for svc in cluster.services.values():
            if svc is not syncer:
                svc.stop(timeout_s=10.0)
        syncer.stop()
        wait_until(lambda: not dashboard.state_json()["available"], timeout_s=60, what="the syncer to be seen down")
        down = _browser(chromium, profile, "--dump-dom", url)
        assert "syncer unavailable" in _element(down, "conn", "div")
        assert 'data-learner="learner-0"' in down  # the last state seen stays on the page
    finally:
        dashboard.stop()
        probe.close()
