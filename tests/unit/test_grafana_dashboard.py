"""The Grafana dashboard only queries metrics the services actually define."""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _defined_metric_names() -> set[str]:
    names = set()
    for path in [*ROOT.glob("ddiloco/**/*.py"), *ROOT.glob("services/**/*.py")]:
        names.update(re.findall(r'"(ddiloco_[a-z0-9_]+)"', path.read_text()))
    return names


def test_every_panel_queries_defined_metrics():
    dashboard = json.loads((ROOT / "k8s" / "grafana" / "ddiloco-dashboard.json").read_text())
    defined = _defined_metric_names()
    assert len(dashboard["panels"]) >= 15
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"ddiloco_[a-z0-9_]+", target["expr"]):
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
