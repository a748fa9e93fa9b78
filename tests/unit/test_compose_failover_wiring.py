"""docker-compose.failover.yml, checked from the files alone (no Docker engine; the container test
is tests/docker/test_compose_failover.py): merged over docker-compose.yml, two syncers of the same
run elect a leader on a 3-member etcd cluster whose members are all reachable from both, write to
both stores, and every learner is given both syncers at addresses they can reach."""

from __future__ import annotations

import pathlib

import yaml

from services.learner import config as learner_config
from services.syncer import config as syncer_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OVERRIDE = yaml.safe_load((ROOT / "docker-compose.failover.yml").read_text())
SYNCERS = ("syncer", "syncer-b")
ETCD = ("etcd-a", "etcd-b", "etcd-c")


def _merged(name: str) -> dict:
    """Compose's merge for the keys used here: mappings merge, sequences (networks) are unioned."""
    base, over = BASE["services"].get(name, {}), OVERRIDE["services"].get(name, {})
    merged = {**base, **over}
    merged["environment"] = {**base.get("environment", {}), **over.get("environment", {})}
    merged["networks"] = set(base.get("networks", [])) | set(over.get("networks", []))
    merged["depends_on"] = {**base.get("depends_on", {}), **over.get("depends_on", {})}
    return merged


def _reach(a: str, b: str) -> bool:
    return bool(_merged(a)["networks"] & _merged(b)["networks"])


def test_both_syncers_run_the_same_run_and_differ_only_in_their_advertised_address() -> None:
    a, b = (_merged(s)["environment"] for s in SYNCERS)
    assert a["DDILOCO_SYNCER_COORD_ADVERTISE"] == "syncer:50051"
    assert b["DDILOCO_SYNCER_COORD_ADVERTISE"] == "syncer-b:50051"
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differ == {"DDILOCO_SYNCER_COORD_ADVERTISE"}, differ
    fields = {f.name.upper() for f in syncer_config.dataclasses.fields(syncer_config.SyncerConfig)}
    for key in b:
        if key.startswith("DDILOCO_SYNCER_"):
            assert key.removeprefix("DDILOCO_SYNCER_") in fields, key


def test_the_syncers_reach_three_etcd_members_and_both_stores() -> None:
    for name in SYNCERS:
        syncer = _merged(name)
        env = syncer["environment"]
        endpoints = [e.split(":")[0] for e in env["DDILOCO_SYNCER_COORD_ETCD"].split(",")]
        assert sorted(endpoints) == list(ETCD)
        stores = [t.split(":")[0] for t in env["DDILOCO_SYNCER_CHECKPOINT_TARGET"].split(",")]
        assert stores == ["checkpoint", "checkpoint-b"]
        for other in [*endpoints, *stores]:
            assert _reach(name, other), (name, other)
        for store in stores:
            assert syncer["depends_on"][store]["condition"] == "service_healthy"
    assert not _reach("checkpoint", "checkpoint-b"), "the two stores share a network"


def test_the_etcd_members_form_one_cluster_of_three_in_three_regions() -> None:
    clusters = set()
    for name in ETCD:
        env = _merged(name)["environment"]
        assert env["ETCD_NAME"] == name
        assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"http://{name}:2380"
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"http://{name}:2379"
        clusters.add(env["ETCD_INITIAL_CLUSTER"])
        assert all(_reach(name, peer) for peer in ETCD if peer != name), name
    [cluster] = clusters
    assert dict(m.split("=") for m in cluster.split(",")) == {n: f"http://{n}:2380" for n in ETCD}
    # Each member sits in its own region: the hub of a syncer and a store, or region-c alone.
    home = {"etcd-a": "hub", "etcd-b": "hub-b", "etcd-c": "region-c"}
    assert _merged("checkpoint")["networks"] >= {home["etcd-a"]} and _merged("checkpoint-b")["networks"] == {"hub-b"}
    assert all(home[n] in _merged(n)["networks"] for n in ETCD)
    assert not any("region-c" in _merged(s)["networks"] for s in ("checkpoint", "checkpoint-b"))


def test_every_learner_is_given_both_syncers_and_reaches_them() -> None:
    fields = {f.name.upper() for f in learner_config.dataclasses.fields(learner_config.LearnerConfig)}
    assert "SYNCER" in fields
    for name in ("learner-region-a", "learner-region-b", "chaos-learner"):
        targets = _merged(name)["environment"]["DDILOCO_LEARNER_SYNCER"].split(",")
        assert targets == ["syncer:50051", "syncer-b:50051"], (name, targets)
        assert all(_reach(name, t.split(":")[0]) for t in targets), name


def test_the_evaluator_is_given_both_syncers_and_reaches_them() -> None:
    targets = _merged("evaluator")["environment"]["DDILOCO_EVAL_SYNCER"].split(",")
    assert targets == ["syncer:50051", "syncer-b:50051"], targets
    assert all(_reach("evaluator", t.split(":")[0]) for t in targets)


def test_every_network_and_volume_used_is_declared() -> None:
    networks = set(BASE["networks"]) | set(OVERRIDE["networks"])
    volumes = set(BASE["volumes"]) | set(OVERRIDE["volumes"])
    for name, service in OVERRIDE["services"].items():
        assert _merged(name)["networks"] <= networks, name
        for mount in service.get("volumes", []):
            assert mount.split(":")[0] in volumes, (name, mount)
