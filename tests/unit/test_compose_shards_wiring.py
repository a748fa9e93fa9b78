"""docker-compose.shards.yml, checked from the files alone (no Docker engine): merged over
docker-compose.yml, two syncer shards with the same settings but their index, one shard map
naming both (in index order, at the port each binds), every learner and the evaluator pointed
at shard 0 and started once both shards serve, and both shards reachable from every network
their clients sit on (issue 21, fragment shards)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import sys

import yaml

from services.syncer import config as syncer_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OVERRIDE = yaml.safe_load((ROOT / "docker-compose.shards.yml").read_text())
CLIENTS = {"learner-region-a": "DDILOCO_LEARNER_SYNCER", "learner-region-b": "DDILOCO_LEARNER_SYNCER",
           "chaos-learner": "DDILOCO_LEARNER_SYNCER", "evaluator": "DDILOCO_EVAL_SYNCER"}


def _merged_service(name: str) -> dict:
    """Compose's merge for the keys used here: mappings merge, sequences (networks) are unioned."""
    base, over = dict(BASE["services"].get(name, {})), OVERRIDE["services"].get(name, {})
    merged = {**base, **{k: v for k, v in over.items() if k not in ("environment", "networks", "depends_on")}}
    merged["environment"] = {**base.get("environment", {}), **over.get("environment", {})}
    merged["networks"] = sorted(set(base.get("networks", [])) | set(over.get("networks", [])))
    merged["depends_on"] = {**base.get("depends_on", {}), **over.get("depends_on", {})}
    return merged


def _shards() -> list[tuple[str, dict]]:
    """(service, merged definition) of every syncer shard, in the map's order."""
    shard_map = _merged_service("syncer")["environment"]["DDILOCO_SYNCER_FRAGMENT_SHARDS"].split(",")
    return [(entry.split(":")[0], _merged_service(entry.split(":")[0])) for entry in shard_map]


def test_two_shards_with_one_map_their_own_index_and_the_same_settings() -> None:
    shards = _shards()
    assert [name for name, _ in shards] == ["syncer", "syncer-1"]
    maps = {svc["environment"]["DDILOCO_SYNCER_FRAGMENT_SHARDS"] for _, svc in shards}
    (shard_map,) = maps
    for index, (name, svc) in enumerate(shards):
        env = svc["environment"]
        assert env["DDILOCO_SYNCER_FRAGMENT_SHARD"] == str(index)
        assert svc["command"] == ["syncer"]
        port = env["DDILOCO_SYNCER_BIND"].rsplit(":", 1)[1]
        assert shard_map.split(",")[index] == f"{name}:{port}"
        assert svc["healthcheck"]["test"][-1].endswith(f":{port}")
        assert svc["depends_on"]["checkpoint"]["condition"] == "service_healthy"
    # The shards differ in their index only: another model, run id or fragment count on one of
    # them would be another run.
    envs = [{k: v for k, v in svc["environment"].items() if k != "DDILOCO_SYNCER_FRAGMENT_SHARD"} for _, svc in shards]
    assert envs[0] == envs[1]
    assert len(shards) <= int(envs[0]["DDILOCO_SYNCER_NUM_FRAGMENTS"].split(":-")[1].rstrip("}"))
    assert "ports" not in OVERRIDE["services"]["syncer-1"]  # only shard 0 is published on the host


def test_clients_are_given_shard_0_reach_every_shard_and_wait_for_all() -> None:
    shards = _shards()
    first = _merged_service("syncer")["environment"]["DDILOCO_SYNCER_FRAGMENT_SHARDS"].split(",")[0]
    for client, variable in CLIENTS.items():
        svc = _merged_service(client)
        assert svc["environment"][variable] == first, client
        for name, shard in shards:
            assert set(svc["networks"]) & set(shard["networks"]), f"{client} cannot reach {name}"
            assert svc["depends_on"][name]["condition"] == "service_healthy", client
    status = _merged_service("status")
    assert status["entrypoint"][-1] == first and status["profiles"] == ["tools"]
    for name, shard in shards:
        assert set(status["networks"]) & set(shard["networks"]), f"status cannot reach {name}"


def test_the_override_sets_only_flags_the_syncer_has() -> None:
    """Syncer flags, or the fragment-shard flags the Helm chart wires too (scripts/render_k8s.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import render_k8s
    finally:
        sys.path.pop(0)
    fields = {f.name.upper() for f in dataclasses.fields(syncer_config.SyncerConfig)}
    fields |= {name.upper() for name in render_k8s.WIRED_SHARDS["syncer"]}
    for service in ("syncer", "syncer-1"):
        for key in OVERRIDE["services"][service]["environment"]:
            if key.startswith("DDILOCO_SYNCER_"):
                assert key.removeprefix("DDILOCO_SYNCER_") in fields, key


def test_the_compose_header_names_the_override() -> None:
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:", 1)[0]
    assert "docker-compose.shards.yml" in header


# ---------------------------------------------------------------------------- monitoring and TLS

PROMETHEUS = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
DASHBOARD = json.loads((ROOT / "k8s" / "grafana" / "ddiloco-dashboard.json").read_text())
TLS = yaml.safe_load((ROOT / "docker-compose.tls.yml").read_text())
SHARDS_TLS = yaml.safe_load((ROOT / "docker-compose.shards-tls.yml").read_text())


def _scraped_as_syncer() -> dict[str, int]:
    """Compose service name -> port of every Prometheus target whose series carry job="syncer"
    (after relabeling); a DNS-found target must be named after its service, as a static one is."""
    out = {}
    for job in PROMETHEUS["scrape_configs"]:
        relabeled = {r["target_label"]: r.get("replacement") for r in job.get("relabel_configs", [])}
        if relabeled.get("job", job["job_name"]) != "syncer":
            continue
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                out[host] = int(port)
        for dns in job.get("dns_sd_configs", []):
            assert relabeled.get("instance") == f"${{1}}:{dns['port']}", job["job_name"]
            out.update({name: int(dns["port"]) for name in dns["names"]})
    return out


def test_prometheus_scrapes_every_shard_as_the_syncer_job_on_a_shared_network() -> None:
    """Before: only shard 0 (syncer:9091) was scraped."""
    scraped, prometheus = _scraped_as_syncer(), BASE["services"]["prometheus"]
    for name, svc in _shards():
        port = int(svc["environment"]["DDILOCO_SYNCER_METRICS_BIND"].rsplit(":", 1)[1])
        assert scraped.get(name) == port, f"{name} is not scraped at its metrics port {port}"
        assert set(svc["networks"]) & set(prometheus["networks"]), f"prometheus cannot reach {name}"


# Gauges every shard exports for the whole run: each counts the same learners and is told the same
# evaluations (their max is the run's), and each shard's work merged is its fragments' share of
# P x tokens processed (their sum is the run's). A bare query would draw one line per shard.
_RUN_GAUGES = {"ddiloco_learners": "max", "ddiloco_heldout_loss": "max",
               "ddiloco_work_merged_ratio": "sum", "ddiloco_goodput_ratio": "sum"}


def test_the_dashboard_aggregates_the_shards_series() -> None:
    seen = set()
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for metric, aggregation in _RUN_GAUGES.items():
                if re.search(rf"\b{metric}\b", expr):
                    seen.add(metric)
                    assert re.fullmatch(rf"{aggregation}( by \([a-z_, ]+\))? ?\({metric}\)", expr), (panel["title"], expr)
            # Counters and histograms of the syncer are summed over instances (rates of every shard).
            for name in re.findall(r"rate\((ddiloco_syncer_[a-z_]+_(?:total|bucket))", expr):
                assert expr.startswith("sum") or expr.startswith("histogram_quantile(sum by (le)") or \
                    expr.startswith("histogram_quantile(") and "sum by (le)" in expr, (name, expr)
    assert seen == set(_RUN_GAUGES)


def _merged(name: str, files: list[dict]) -> dict:
    """Compose's merge over several files, for the keys checked here (volumes: by mount point)."""
    out: dict = {"environment": {}, "depends_on": {}, "volumes": {}}
    for doc in files:
        svc = doc["services"].get(name, {})
        out.update({k: v for k, v in svc.items() if k not in out})
        out["environment"].update(svc.get("environment", {}))
        out["depends_on"].update(svc.get("depends_on", {}))
        out["volumes"].update({v.split(":")[1]: v for v in svc.get("volumes", [])})
    return out


def test_under_tls_shard_1_is_configured_as_shard_0_and_named_in_the_syncer_certificate() -> None:
    """Before: docker-compose.tls.yml configured shard 0 only; syncer-1 stayed plaintext."""
    files = [BASE, OVERRIDE, TLS, SHARDS_TLS]
    zero = _merged("syncer", files)
    tls_env = set(TLS["services"]["syncer"]["environment"])
    assert "DDILOCO_SYNCER_TLS_CERT" in tls_env
    certs = SHARDS_TLS["services"]["certs-shards"]
    script = certs["command"][0]
    named = set(re.search(r"--services syncer --dns-names (\S+)", script).group(1).split(","))
    for name, _ in _shards()[1:]:
        shard = _merged(name, files)
        assert {k: shard["environment"].get(k) for k in tls_env} == {k: zero["environment"][k] for k in tls_env}, name
        assert shard["environment"]["DDILOCO_INSECURE"] == "0"
        assert shard["volumes"] == zero["volumes"], name  # the syncer's certificate and the deny list
        assert shard["healthcheck"]["test"] == zero["healthcheck"]["test"], name  # the plaintext health port
        assert name in named, f"the syncer certificate does not name {name}"
    for svc in (zero, *(_merged(name, files) for name, _ in _shards()[1:])):
        assert svc["depends_on"]["certs-shards"]["condition"] == "service_completed_successfully"
    assert certs["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert {v.split(":")[0] for v in certs["volumes"]} <= set(TLS["volumes"])
    assert "cp /tls/ca/syncer.pem /tls/syncer/tls.pem" in script and "chmod 0600 /tls/syncer/tls.key" in script
