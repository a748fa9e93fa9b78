"""The Grafana dashboard only queries metrics the services actually define, and never takes the
rate of a gauge."""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
# Our metrics and the gRPC server metrics (ddiloco/rpc/interceptors.py), as the code spells them.
_NAME = r"(?:ddiloco|grpc_server)_[a-z0-9_]+"
# Series that only go up (or reset): counters (exposed as <name>_total, checked by promtool in
# tests/service/test_metrics_exposition.py) and histograms' parts. rate() of anything else is wrong.
_RATE_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _defined_metric_names() -> set[str]:
    names = set()
    for path in [*ROOT.glob("ddiloco/**/*.py"), *ROOT.glob("services/**/*.py")]:
        names.update(re.findall(rf'"({_NAME})"', path.read_text()))
    return names


def test_every_panel_queries_defined_metrics():
    dashboard = json.loads((ROOT / "k8s" / "grafana" / "ddiloco-dashboard.json").read_text())
    defined = _defined_metric_names()
    assert len(dashboard["panels"]) >= 15
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(_NAME, target["expr"]):
                base = name
                for suffix in _SUFFIXES:
                    if base.endswith(suffix) and base[: -len(suffix)] in defined:
                        base = base[: -len(suffix)]
                used.add(base)
                assert base in defined, f"panel {panel['title']!r} queries {name}, which no service exports"
    # The dashboard covers what operators asked for: quorum, grace, staleness, goodput, losses.
    for must in ("ddiloco_syncer_merge_contributors", "ddiloco_syncer_grace_used_seconds",
                 "ddiloco_syncer_contribution_staleness_versions", "ddiloco_goodput_ratio", "ddiloco_heldout_loss"):
        assert must in used


def test_no_panel_takes_the_rate_of_a_gauge():
    dashboard = json.loads((ROOT / "k8s" / "grafana" / "ddiloco-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for fn, name in re.findall(rf"\b(rate|irate|increase)\(\s*({_NAME})", target["expr"]):
                assert name.endswith(_RATE_SUFFIXES), f"panel {panel['title']!r} takes {fn}() of {name}, not a counter"
