"""syncer.shards (issue 21, fragment shards), rendered with real helm: one syncer by default,
exactly as before; N shards render N Services, Deployments and PodDisruptionBudgets, each
selecting only its own pods and each given its index and the one map of the shards' Services, to
which the learners' address (shard 0) and the syncer NetworkPolicy (every shard's pods) agree.

Before syncer.shards the chart had one syncer Deployment whatever the values said; a Service
selecting by component alone would have spread one shard's clients over every shard's pods.
"""

from __future__ import annotations

import json

import pytest

from tests.k8s.conftest import CHART, validate_strictly
from tests.k8s.manifests import container_env, find, first_pod_name, learner_sets, selects

_SHARD_LABEL = "ddiloco/syncer-shard"


def _syncer(docs, kind: str) -> list[dict]:
    return find(docs, kind, component="syncer")


def test_one_shard_is_the_unsharded_syncer(render):
    docs = render("default")
    (deployment,) = _syncer(docs, "Deployment")
    (service,) = _syncer(docs, "Service")
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "ddiloco-syncer"
    assert _SHARD_LABEL not in deployment["spec"]["template"]["metadata"]["labels"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = container_env(docs, deployment, container, first_pod_name(deployment))
    assert not [k for k in env if "FRAGMENT_SHARD" in k]


def test_three_shards_each_its_own_service_pods_index_and_the_one_map(render, k8s_versions):
    docs = render("default", "--set", "syncer.shards=3")
    problems = validate_strictly(docs, k8s_versions)
    assert not problems, "\n".join(problems)
    names = ["ddiloco-syncer", "ddiloco-syncer-1", "ddiloco-syncer-2"]
    deployments = {d["metadata"]["name"]: d for d in _syncer(docs, "Deployment")}
    services = {s["metadata"]["name"]: s for s in _syncer(docs, "Service")}
    pdbs = {p["metadata"]["name"]: p for p in _syncer(docs, "PodDisruptionBudget")}
    assert sorted(deployments) == sorted(services) == sorted(pdbs) == names
    maps = set()
    for index, name in enumerate(names):
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert pod_labels[_SHARD_LABEL] == str(index)
        for other, deployment in deployments.items():
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            # A shard's Service and PodDisruptionBudget cover its own pods and no other shard's.
            assert selects({"matchLabels": services[name]["spec"]["selector"]}, labels) == (other == name)
            assert selects(pdbs[name]["spec"]["selector"], labels) == (other == name)
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        env = container_env(docs, deployments[name], container, first_pod_name(deployments[name]))
        assert env["DDILOCO_SYNCER_FRAGMENT_SHARD"] == str(index)
        maps.add(env["DDILOCO_SYNCER_FRAGMENT_SHARDS"])
    (shard_map,) = maps  # the same map on every shard
    port = services["ddiloco-syncer"]["spec"]["ports"][0]["port"]
    assert shard_map.split(",") == [f"{n}:{port}" for n in names]
    # Learners are given shard 0 (they find the others in its Join answer) ...
    sts = learner_sets(docs)[0]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container_env(docs, sts, container, first_pod_name(sts))["DDILOCO_LEARNER_SYNCER"] == f"{names[0]}:{port}"
    # ... and may reach every shard: the syncer NetworkPolicy selects every shard's pods.
    (policy,) = find(docs, "NetworkPolicy", "ddiloco-syncer")
    for deployment in deployments.values():
        assert selects(policy["spec"]["podSelector"], deployment["spec"]["template"]["metadata"]["labels"])


def test_shard_addresses_replace_the_service_names_in_the_map(render):
    docs = render("hub", "--set", "syncer.shards=2",
                  "--set", "syncer.shardAddresses={s0.hub.example.com:50051,s1.hub.example.com:50051}")
    for deployment in _syncer(docs, "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = container_env(docs, deployment, container, first_pod_name(deployment))
        assert env["DDILOCO_SYNCER_FRAGMENT_SHARDS"] == "s0.hub.example.com:50051,s1.hub.example.com:50051"


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"syncer": {"shards": 5}}, "more than syncer.settings.numFragments=4"),
        ({"syncer": {"shards": 2, "shardAddresses": ["a:1"]}}, "shardAddresses has 1 entries"),
        ({"syncer": {"shards": 0}}, "/syncer/shards"),
        ({"syncer": {"shards": 2, "shardAddresses": ["a:1|b:1", "c:1"]}}, "/syncer/shardAddresses"),
    ],
)
def test_shard_values_that_cannot_work_are_refused(tools, tmp_path, values, complaint):
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(json.dumps(values))
    proc = tools.helm_run("template", "ddiloco", str(CHART), "--values", str(bad), check=False)
    assert proc.returncode != 0 and complaint in proc.stdout + proc.stderr, proc.stderr


def test_shards_with_standbys_each_shard_elects_its_own_leader_behind_its_own_service(render, k8s_versions):
    """syncer.shards=2 with replicas=2 and settings.coordEtcd (issue 23 per shard): each shard's
    Deployment runs 2 pods that elect a leader through the etcd, under the shard's own election key
    and commit pointer (the syncer's `<run>.shard-I-of-N`, from the index the pods are given), and
    rolls one pod at a time. The map names each shard by its Service, which selects both of its
    pods and no other shard's: a learner's session to a shard lands on either pod, and a standby
    refuses it naming its leader's pod IP (each pod advertises its own), so the session follows
    to the shard's leader; when that leader dies, the session dials the Service again."""
    from ddiloco.coord import election as election_lib
    from services.syncer import config as syncer_config

    docs = render("default", "--set", "syncer.shards=2", "--set", "syncer.replicas=2",
                  "--set", "syncer.settings.coordEtcd=etcd-0.etcd:2379\\,etcd-1.etcd:2379")
    problems = validate_strictly(docs, k8s_versions)
    assert not problems, "\n".join(problems)
    deployments = {d["metadata"]["name"]: d for d in _syncer(docs, "Deployment")}
    services = {s["metadata"]["name"]: s for s in _syncer(docs, "Service")}
    names = ["ddiloco-syncer", "ddiloco-syncer-1"]
    assert sorted(deployments) == sorted(services) == names
    port = services[names[0]]["spec"]["ports"][0]["port"]
    keys, maps = set(), set()
    for index, name in enumerate(names):
        deployment = deployments[name]
        assert deployment["spec"]["replicas"] == 2
        assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                                  "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        for other in names:
            labels = deployments[other]["spec"]["template"]["metadata"]["labels"]
            assert selects({"matchLabels": services[name]["spec"]["selector"]}, labels) == (other == name)
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = container_env(docs, deployment, container, first_pod_name(deployment))
        assert env["DDILOCO_SYNCER_COORD_ETCD"] == "etcd-0.etcd:2379,etcd-1.etcd:2379"
        assert "DDILOCO_SYNCER_COORD_ADVERTISE" not in env  # each pod advertises its own IP to learners
        cfg = syncer_config.parse_config([], env)
        assert cfg.fragment_shard == index
        keys.add(election_lib.leader_key(cfg.coord_prefix, cfg.store_run_id))
        maps.add(env["DDILOCO_SYNCER_FRAGMENT_SHARDS"])
    assert len(keys) == 2  # one election (and commit pointer) per shard
    (shard_map,) = maps  # the same map on every pod of every shard: one Service per shard
    assert shard_map.split(",") == [f"{n}:{port}" for n in names]
