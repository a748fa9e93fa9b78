"""The compose profile `monitoring` on a real Docker engine: Prometheus (Debian's package, in an image
built here offline) scrapes every service, loads our alerting rules, and answers every query of
the Grafana dashboard with data.

The stack: store, syncer, one learner per region, the evaluator (its held-out loss is a panel) and
Prometheus. Grafana is not started: its official image must be pulled and no Grafana build is
installable offline (docker-compose.yml says so); what it would show is exactly what these
queries return from this Prometheus. One learner is killed and started again during the run, so
the rejoin panel has an observation. Checks, each with a bounded wait:
  * every learner container's healthcheck (its liveness endpoint) reports healthy;
  * Prometheus has one target per service and per learner replica, every one `up`;
  * every rule of deploy/prometheus/rules.yml is loaded and evaluates without error;
  * every PromQL query of k8s/grafana/ddiloco-dashboard.json (read at run time, so renamed metrics
    are followed) returns at least one series with a finite value;
  * Prometheus's own graph page, in headless Chromium (scripts/browser_env.sh), draws the syncer's
    outer steps (its legend names the syncer's series): a screenshot in the test's tmp dir, also
    copied to docs/prometheus-graph.png (the README's) with DDILOCO_UPDATE_SCREENSHOT=1, as
    tests/integration/test_dashboard_browser.py does for docs/dashboard.png.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

import pytest
import yaml

from tests import browser
from tests import ports, waits
from tests.docker import conftest as dc

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1500)]

DASHBOARD = dc.REPO / "k8s" / "grafana" / "ddiloco-dashboard.json"
RULES = dc.REPO / "deploy" / "prometheus" / "rules.yml"
PROFILES = ("--profile", "monitoring", "--profile", "eval")
# Everything of the two profiles but Grafana (pulled, not built: not available offline).
SERVICES = ("checkpoint", "syncer", "learner-region-a", "learner-region-b", "evaluator", "prometheus")
LEARNER_SERVICES = ("learner-region-a", "learner-region-b")
LEARNERS_PER_REGION = 1
# Jobs of deploy/prometheus/prometheus.yml -> targets expected (learners: one per replica).
JOBS = {"syncer": 1, "checkpoint": 1, "learner": LEARNERS_PER_REGION * len(LEARNER_SERVICES), "prometheus": 1}
# Grafana's built-in interval variables, as Grafana would expand them for a 5 s scrape interval.
GRAFANA_BUILTINS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "15m"}
# The key series drawn on Prometheus's graph page for the screenshot (docs/prometheus-graph.png).
GRAPH_EXPR = "ddiloco_syncer_outer_steps_total"
SCREENSHOT = dc.REPO / "docs" / "prometheus-graph.png"


def wait_until(predicate: Callable[[], object], *, timeout_s: float, what: str, interval_s: float = 2.0,
               describe: Callable[[], str] | None = None):
    """Polls over HTTP; HTTP and connection errors (Prometheus not answering yet) count as "not yet"."""
    return waits.wait_until(predicate, timeout_s=timeout_s, what=what, interval_s=interval_s, describe=describe,
                            not_yet=(urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError))


class Prometheus:
    """Prometheus's HTTP API through its published port; every call has a deadline."""

    def __init__(self, address: str) -> None:
        self.base = f"http://{address}/api/v1"

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.base}/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.get("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def targets(self) -> list[dict]:
        return self.get("targets", state="active")["activeTargets"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title and refId, PromQL) of every target of every panel (rows' panels included)."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}

    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    out = []
    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = target.get("expr", "").strip()
            if not expr:
                continue
            for name, value in GRAFANA_BUILTINS.items():
                expr = expr.replace(name, value)
            unknown = set(re.findall(r"\$\{?(\w+)", expr))
            assert not unknown, (f"panel {panel.get('title')!r} uses dashboard variables {unknown} "
                                 f"(dashboard variables: {variables}): teach this test their values")
            out.append((f"{panel.get('title')} [{target.get('refId', '?')}]", expr))
    return out


def rule_names() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule.get("alert") or rule.get("record") for group in groups for rule in group["rules"]}


def finite_values(result: list[dict]) -> list[float]:
    values = [float(series["value"][1]) for series in result if "value" in series]
    values += [float(v) for series in result for _, v in series.get("values", [])]
    return [v for v in values if math.isfinite(v)]


def test_monitoring_profile_scrapes_every_service_and_feeds_every_dashboard_query(
        compose_project: dc.ComposeProject, tmp_path) -> None:
    assert RULES.exists(), f"{RULES} is missing: the monitoring profile's Prometheus loads it"
    queries = dashboard_queries()
    assert queries, f"no PromQL query found in {DASHBOARD}"
    project = compose_project
    prometheus_port = ports.free_port()
    project.env.update({
        "DDILOCO_IMAGE": "ddiloco:e2e",
        "DDILOCO_PROMETHEUS_IMAGE": "ddiloco-prometheus:e2e",
        "DDILOCO_SYNCER_PUBLISH": f"127.0.0.1:{ports.free_port()}",
        "DDILOCO_PROMETHEUS_PUBLISH": f"127.0.0.1:{prometheus_port}",
        "DDILOCO_RUN_ID": "monitoring",
        "DDILOCO_MODEL_CONFIG": json.dumps({"preset": "tiny"}),
        "DDILOCO_NUM_FRAGMENTS": "4",
        "DDILOCO_SYNC_PERIOD_STEPS": "4",
        "DDILOCO_MIN_QUORUM": "1",
        "DDILOCO_CHECKPOINT_EVERY_MERGES": "4",
        "DDILOCO_LIVENESS_TIMEOUT_S": "4",
        "DDILOCO_LEARNERS_PER_REGION": str(LEARNERS_PER_REGION),
        "DDILOCO_STEP_DELAY_S": "0.05",
        "DDILOCO_BATCH_SIZE": "8",
        "DDILOCO_EVAL_INTERVAL_S": "5",
        "DDILOCO_LOG_LEVEL": "INFO",
    })
    prometheus = Prometheus(f"127.0.0.1:{prometheus_port}")
    browser.chromium()  # before the stack starts: no browser fails the test without a run
    try:
        _scenario(project, prometheus, queries, tmp_path)
    except BaseException:
        done = project.compose(*PROFILES, "logs", "--no-color", "--tail", "100000", timeout=60, check=False)
        dc.report_logs(project.name, done.stdout + done.stderr, tmp_path)
        raise
    finally:
        # With the profiles, so that their services and Prometheus's volume go too (the fixture's
        # own `down` knows no profile).
        project.compose(*PROFILES, "down", "--volumes", "--remove-orphans", "--timeout", "5", timeout=180, check=False)
    leftovers = project.leftovers()
    assert leftovers == {"containers": [], "networks": [], "volumes": []}, leftovers


_record = functools.partial(dc.record_timing, "docker monitoring")


def graph_url(address: str, expr: str, range_input: str = "1m") -> str:
    """Prometheus's graph page with expr on the graph tab (the same parameters for its old and new UI)."""
    return f"http://{address}/graph?" + urllib.parse.urlencode(
        {"g0.expr": expr, "g0.tab": "0", "g0.range_input": range_input, "g0.stacked": "0"})


def _scenario(project: dc.ComposeProject, prometheus: Prometheus, queries: list[tuple[str, str]],
              tmp_path: pathlib.Path) -> None:
    _build_and_start(project)
    t0 = time.monotonic()
    _wait_merging(prometheus, t0)
    _wait_learners_healthy(project, t0)
    _kill_and_rejoin(project, prometheus, t0)
    _wait_targets_up(prometheus, t0)
    _wait_rules_loaded(prometheus, t0)
    _wait_dashboard_queries(prometheus, queries, t0)
    _graph_page(prometheus, tmp_path)


def _build_and_start(project: dc.ComposeProject) -> None:
    """Builds the ddiloco image and Prometheus's (offline) and starts the stack."""
    t = time.monotonic()
    project.compose(*PROFILES, "build", "checkpoint", "prometheus", timeout=900)
    build_s = time.monotonic() - t
    t = time.monotonic()
    project.compose(*PROFILES, "up", "--detach", *SERVICES, timeout=300)
    _record("monitoring-up", build_s=build_s, up_s=time.monotonic() - t)


def _wait_merging(prometheus: Prometheus, t0: float) -> None:
    """Training reaches Prometheus: 8 merges scraped."""
    def merges() -> float:
        result = prometheus.query("sum(ddiloco_syncer_merges_total)")
        return float(result[0]["value"][1]) if result else 0.0

    wait_until(lambda: merges() >= 8, timeout_s=300, what="8 merges, as scraped by Prometheus")
    _record("monitoring-merging", s=time.monotonic() - t0)


def _wait_learners_healthy(project: dc.ComposeProject, t0: float) -> None:
    """The learners' healthcheck: their liveness endpoint answers SERVING."""
    learners = [cid for service in LEARNER_SERVICES for cid in project.container_ids(service)]
    assert len(learners) == JOBS["learner"], learners

    def health() -> dict[str, str]:
        return {cid[:12]: (project.inspect(cid)["State"].get("Health") or {}).get("Status", "none") for cid in learners}

    wait_until(lambda: set(health().values()) == {"healthy"}, timeout_s=180, what="every learner healthy",
               describe=lambda: f"health: {health()}")
    _record("monitoring-learners-healthy", s=time.monotonic() - t0)


def _kill_and_rejoin(project: dc.ComposeProject, prometheus: Prometheus, t0: float) -> None:
    """A learner dies and comes back (a new incarnation): the rejoin panel gets a point."""
    project.compose("kill", "--signal", "SIGKILL", "learner-region-b", timeout=60)
    project.compose("start", "learner-region-b", timeout=120)

    def rejoins() -> float:
        result = prometheus.query("sum(ddiloco_syncer_rejoin_seconds_count)")
        return float(result[0]["value"][1]) if result else 0.0

    wait_until(lambda: rejoins() >= 1, timeout_s=180, what="a rejoin observed by the syncer")
    _record("monitoring-rejoined", s=time.monotonic() - t0)


def _wait_targets_up(prometheus: Prometheus, t0: float) -> None:
    """Every scrape target up."""
    def targets_summary() -> dict[str, list[tuple[str, str, str]]]:
        out: dict[str, list[tuple[str, str, str]]] = {}
        for target in prometheus.targets():
            out.setdefault(target["labels"]["job"], []).append(
                (target["scrapeUrl"], target["health"], target.get("lastError", "")))
        return out

    def all_up() -> bool:
        summary = targets_summary()
        return ({job: len(ts) for job, ts in summary.items()} == JOBS
                and all(health == "up" for ts in summary.values() for _, health, _ in ts))

    wait_until(all_up, timeout_s=180, what=f"every target up ({JOBS})",
               describe=lambda: json.dumps(targets_summary(), indent=1))
    _record("monitoring-targets-up", s=time.monotonic() - t0, targets=sum(JOBS.values()))


def _wait_rules_loaded(prometheus: Prometheus, t0: float) -> None:
    """Our alerting rules are loaded and evaluate."""
    expected_rules = rule_names()
    assert expected_rules, f"{RULES} defines no rule"

    def loaded_rules() -> dict[str, tuple[str, str]]:
        groups = prometheus.get("rules")["groups"]
        return {r["name"]: (r.get("health", ""), r.get("lastError", "")) for g in groups for r in g["rules"]}

    def rules_ok() -> bool:
        loaded = loaded_rules()
        return set(loaded) == expected_rules and all(h == "ok" for h, _ in loaded.values())

    wait_until(rules_ok, timeout_s=120, what=f"the {len(expected_rules)} rules of {RULES.name} loaded and evaluated",
               describe=lambda: json.dumps(loaded_rules(), indent=1))
    _record("monitoring-rules-loaded", s=time.monotonic() - t0, rules=len(expected_rules))


def _wait_dashboard_queries(prometheus: Prometheus, queries: list[tuple[str, str]], t0: float) -> None:
    """Every dashboard query returns data."""
    def missing() -> dict[str, str]:
        out = {}
        for title, expr in queries:
            try:
                result = prometheus.query(expr)
            except urllib.error.HTTPError as exc:  # Prometheus refused the query: a dashboard bug
                out[title] = f"{expr}  ->  HTTP {exc.code}: {exc.read()[:300]!r}"
                continue
            if not finite_values(result):
                out[title] = f"{expr}  ->  {json.dumps(result)[:300]}"
        return out

    def no_missing() -> bool:
        return not missing()

    wait_until(no_missing, timeout_s=300, what="data for every query of the Grafana dashboard", interval_s=5.0,
               describe=lambda: "queries without a finite value:\n" + "\n".join(
                   f"  {title}: {detail}" for title, detail in missing().items()))
    _record("monitoring-dashboard-queries", s=time.monotonic() - t0, queries=len(queries))


def _graph_page(prometheus: Prometheus, tmp_path: pathlib.Path) -> None:
    """Prometheus's graph page for the key series, in a real browser (and its screenshot)."""
    assert finite_values(prometheus.query(GRAPH_EXPR)), GRAPH_EXPR
    t = time.monotonic()
    address = prometheus.base.removeprefix("http://").removesuffix("/api/v1")
    url = graph_url(address, GRAPH_EXPR)
    dom = browser.run(tmp_path / "chromium-profile", "--dump-dom", url)
    (tmp_path / "prometheus-graph.html").write_text(dom)
    assert "syncer:9091" in dom, f"Prometheus's graph page shows no series of the syncer for {GRAPH_EXPR} " \
                                 f"(page: {tmp_path / 'prometheus-graph.html'})"
    shot = browser.screenshot(url, tmp_path / "prometheus-graph.png", width=1400, height=860)
    if os.environ.get("DDILOCO_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)
    _record("monitoring-screenshot", s=time.monotonic() - t, bytes=shot.stat().st_size)
