"""docker-compose.yml's monitoring wiring, checked from the files alone (no Docker engine): every
service's metrics port is one Prometheus scrapes (deploy/prometheus/prometheus.yml) on a network
Prometheus shares with it, learners are health-checked on the port their health service binds,
Prometheus's image bakes in the rules file, and Grafana is provisioned with that Prometheus and the
dashboard directory. The container tier (tests/docker/test_compose_monitoring.py) runs it for real.
"""

from __future__ import annotations

import json
import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
SCRAPE = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
GRAFANA_PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"


def _env(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[name].get("environment", {}).items()}


def _scraped() -> dict[str, int]:
    """Compose service name -> port, for every target of prometheus.yml."""
    out = {}
    for job in SCRAPE["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                out[host] = int(port)
        for dns in job.get("dns_sd_configs", []):
            assert dns["type"] == "A"
            for name in dns["names"]:
                out[name] = int(dns["port"])
    return out


def test_every_metrics_endpoint_is_scraped_on_a_shared_network():
    scraped = _scraped()
    prometheus = SERVICES["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    exporting = {}
    for name, service in SERVICES.items():
        binds = [v for k, v in _env(name).items() if k.endswith("_METRICS_BIND")]
        if binds:
            (bind,) = binds
            exporting[name] = int(bind.rsplit(":", 1)[1])
            assert bind.startswith("0.0.0.0:"), f"{name}: Prometheus scrapes it from another container"
            shared = set(service["networks"]) & set(prometheus["networks"])
            assert shared, f"{name} shares no network with prometheus"
    # The store, the syncer and every learner service export; the evaluator has no metrics.
    assert {"checkpoint", "syncer", "learner-region-a", "learner-region-b", "chaos-learner"} <= exporting.keys()
    assert {name: scraped.get(name) for name in exporting} == exporting
    assert scraped.get("localhost") == 9090  # Prometheus itself
    assert SCRAPE["rule_files"] == ["/etc/prometheus/rules.yml"]


def test_prometheus_image_bakes_in_the_config_and_our_rules_and_builds_offline():
    build = SERVICES["prometheus"]["build"]
    assert build["context"] == "deploy/prometheus"
    assert build["network"] == "${DDILOCO_BUILD_NETWORK:-default}"  # `none` in CI, as for our image
    dockerfile = (PROMETHEUS_DIR / "Dockerfile").read_text()
    assert re.search(r"^COPY prometheus\.yml rules\.yml /etc/prometheus/$", dockerfile, re.M)
    assert "promtool check config /etc/prometheus/prometheus.yml" in dockerfile
    assert (PROMETHEUS_DIR / "rules.yml").exists(), "the alerting rules the monitoring profile loads"
    # CI's base image already holds the package: the install step must then need no network.
    assert "if ! command -v prometheus" in dockerfile
    env_script = (ROOT / "scripts" / "docker_env.sh").read_text()
    assert "export DDILOCO_PROMETHEUS_BASE_IMAGE=" in env_script
    assert build["args"]["BASE_IMAGE"].startswith("${DDILOCO_PROMETHEUS_BASE_IMAGE:-")


def test_learners_are_health_checked_on_their_health_port():
    for name in ("learner-region-a", "learner-region-b", "chaos-learner"):
        service = SERVICES[name]
        port = int(_env(name)["DDILOCO_LEARNER_HEALTH_BIND"].rsplit(":", 1)[1])
        check = service["healthcheck"]
        assert not check.get("disable")
        assert check["test"][:4] == ["CMD", "python", "-m", "ddiloco.healthcheck"]
        assert check["test"][-2:] == ["--target", f"127.0.0.1:{port}"]


def test_grafana_is_provisioned_with_this_prometheus_and_the_dashboard():
    grafana = SERVICES["grafana"]
    assert grafana["profiles"] == ["monitoring"] and grafana["image"].startswith("${DDILOCO_GRAFANA_IMAGE:-grafana/grafana:")
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (datasource,) = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    host_port = datasource["url"].removeprefix("http://")
    assert host_port == "prometheus:9090" and set(grafana["networks"]) & set(SERVICES["prometheus"]["networks"])
    (provider,) = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "ddiloco.yml").read_text())["providers"]
    assert mounts["./k8s/grafana"] == provider["options"]["path"]
    dashboards = list((ROOT / "k8s" / "grafana").glob("*.json"))
    assert dashboards and all(json.loads(p.read_text())["panels"] for p in dashboards)
    # The dashboard's data-source variable picks a Prometheus data source: the provisioned default.
    for path in dashboards:
        variables = json.loads(path.read_text()).get("templating", {}).get("list", [])
        assert any(v.get("type") == "datasource" and v.get("query") == "prometheus" for v in variables), path
