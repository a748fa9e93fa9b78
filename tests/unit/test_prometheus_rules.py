"""The alerting rules (deploy/prometheus/rules.yml) pass `promtool check rules`,
every rule fires and stays quiet as tests/unit/prometheus_rules_test.yml expects (`promtool test
rules`), and they read only metrics the services define, rate() only of counters.

promtool comes from scripts/promtool_env.sh (Debian's package if missing); none fails the test.
"""

from __future__ import annotations

import pathlib
import re

import yaml

from tests import promtool

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULES_TEST = pathlib.Path(__file__).with_name("prometheus_rules_test.yml")
_NAME = r"(?:ddiloco|grpc_server)_[a-z0-9_]+"
# What an operator is paged for (issue 26): quorum lost, merges stalled, a learner silent,
# checkpoint failures, upload refusals by reason above a rate, syncer restarts.
EXPECTED = {"DdilocoQuorumLost", "DdilocoMergesStalled", "DdilocoSyncerAbsent", "DdilocoLearnerSilent",
            "DdilocoCheckpointFailures", "DdilocoUploadsRefused", "DdilocoSyncerRestarted"}


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_promtool_check_rules_finds_no_problem():
    result = promtool.run("check", "rules", str(RULES))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"SUCCESS: {len(_rules())} rules found" in output, output
    assert "WARNING" not in output.upper(), output


def test_every_rule_passes_its_promtool_unit_tests():
    # rule_files in the test file are relative to it: run from its directory.
    result = promtool.run("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_the_expected_alerts_exist():
    alerts = {rule["alert"] for rule in _rules()}
    assert alerts == EXPECTED
    fired = {case["alertname"] for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
             for case in test["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
             for case in test["alert_rule_test"] if not case["exp_alerts"]}
    assert fired == alerts, alerts - fired
    assert quiet == alerts, alerts - quiet
    for rule in _rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_rules_read_defined_metrics_and_take_rates_of_counters_only():
    defined = set()
    for path in [*ROOT.glob("ddiloco/**/*.py"), *ROOT.glob("services/**/*.py")]:
        defined.update(re.findall(rf'"({_NAME})"', path.read_text()))
    for rule in _rules():
        for name in re.findall(_NAME, rule["expr"]):
            base = name
            for suffix in ("_total", "_info"):  # a Counter's and an Info's exposition of the name in code
                if name.endswith(suffix) and name[: -len(suffix)] in defined:
                    base = name[: -len(suffix)]
            assert base in defined, f"{rule['alert']} reads {name}, which no service exports"
        for fn, name in re.findall(r"\b(rate|irate|increase)\(\s*([a-z_:][a-z0-9_:]*)", rule["expr"]):
            assert name.endswith(("_total", "_bucket", "_sum", "_count")), f"{rule['alert']}: {fn}() of {name}"
