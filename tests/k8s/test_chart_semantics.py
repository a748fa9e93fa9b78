"""Semantic checks of the chart's render that catch real deployment mistakes: a region's learners
pointing elsewhere than the hub, duplicate learner ids or shards, probes on the wrong port, pods
that tolerate node failures too long, a store without a persistent volume, env the services
refuse, pods running as root, GPU learners without devices, store replicas in one zone.
"""

from __future__ import annotations

import json

import pytest

from tests.k8s.conftest import (
    CHART,
    load_values,
    validate_strictly,
)
from tests.k8s.manifests import (
    ALL_VALUES,
    SERVERS,
    container_env,
    find,
    first_pod_name,
    learner_ordinal,
    learner_sets,
    one,
    pod_specs,
    selects,
    workloads,
)

# ---------------------------------------------------------------------------------------------
# Semantics of the rendered output


@pytest.mark.parametrize("name", ["region-a", "region-b"])
def test_region_learners_point_at_the_hub_and_carry_the_region(render, name):
    values = load_values(name)
    docs = render(name)
    hub_port = load_values("hub")["syncer"]["port"]
    assert values["hub"]["syncerAddress"].rsplit(":", 1)[1] == str(hub_port)
    # A region release is a learner pool only: no syncer, store or evaluator of its own.
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component")
                in ("syncer", "store", "evaluator")]
    # One single-pod StatefulSet per learner of the region's ordinal range.
    sets = learner_sets(docs)
    start = values["learners"]["ordinalStart"]
    assert [learner_ordinal(s) for s in sets] == list(range(start, start + values["learners"]["replicas"]))
    templates = [s["spec"]["template"] for s in sets]
    for sts in sets:
        assert sts["spec"]["replicas"] == 1 and "ordinals" not in sts["spec"]
        assert sts["metadata"]["labels"]["ddiloco/region"] == values["region"]
        assert sts["spec"]["template"]["metadata"]["labels"]["ddiloco/region"] == values["region"]
        # Each StatefulSet selects its own pod and no other learner's.
        for other in templates:
            assert selects(sts["spec"]["selector"], other["metadata"]["labels"]) == (other is sts["spec"]["template"])
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        assert container["args"] == ["learner"]
        env = container_env(docs, sts, container, first_pod_name(sts))
        assert env["DDILOCO_LEARNER_SYNCER"] == values["hub"]["syncerAddress"]
        assert env["DDILOCO_LEARNER_REGION"] == values["region"]
        # Learner id = the StatefulSet's name, hence stable across restarts and unique across regions.
        (id_var,) = [v for v in container["env"] if v["name"] == "DDILOCO_LEARNER_LEARNER_ID"]
        assert id_var["value"] == sts["metadata"]["name"] == f"ddiloco-learner-{learner_ordinal(sts)}"
        # Spread over all of the region's learners, not only the StatefulSet's own pod.
        spread = sts["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in spread} >= {"topology.kubernetes.io/zone"}
        assert all(selects(c["labelSelector"], t["metadata"]["labels"]) for c in spread for t in templates)


def test_hub_learners_use_the_in_cluster_syncer_service(render):
    docs = render("hub")
    sts = learner_sets(docs)[0]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    host, port = container_env(docs, sts, container, first_pod_name(sts))["DDILOCO_LEARNER_SYNCER"].rsplit(":", 1)
    (service,) = find(docs, "Service", host)
    (deployment,) = find(docs, "Deployment", component="syncer")
    assert selects({"matchLabels": service["spec"]["selector"]}, deployment["spec"]["template"]["metadata"]["labels"])
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    assert service["spec"]["type"] == "LoadBalancer"  # the other regions come in through it


def test_learner_ids_and_shards_are_unique_across_regions():
    """Disjoint ordinal ranges (learner ids and data shards) and one numShards for the whole run."""
    names = ["hub", "region-a", "region-b"]
    values = {n: load_values(n) for n in names}
    shards = {v["data"]["numShards"] for v in values.values()}
    assert len(shards) == 1, f"data.numShards differs between regions: {shards}"
    taken: dict[int, str] = {}
    for n, v in values.items():
        start, count = v["learners"]["ordinalStart"], v["learners"]["replicas"] if v["learners"]["enabled"] else 0
        for ordinal in range(start, start + count):
            assert ordinal not in taken, f"learner ordinal {ordinal} is in both {taken[ordinal]} and {n}"
            assert ordinal < shards.copy().pop(), f"{n}: ordinal {ordinal} >= data.numShards"
            taken[ordinal] = n
    assert len({v["region"] for v in values.values()}) == len(names), "two releases claim the same region"


@pytest.mark.parametrize("name", ALL_VALUES)
def test_probes_target_the_health_port_the_server_binds(render, name):
    docs = render(name)
    checked = 0
    for workload in workloads(docs):
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if component == "learner":
                # A learner serves only its health service (plaintext, TLS or not), which reports
                # its training loop's liveness: a livenessProbe on the port it binds, nothing else.
                env = container_env(docs, workload, container, first_pod_name(workload))
                health_port = int(env["DDILOCO_LEARNER_HEALTH_BIND"].rsplit(":", 1)[1])
                assert health_port == load_values(name)["learners"]["healthPort"]
                assert {p["name"]: p["containerPort"] for p in container["ports"]}["health"] == health_port
                assert container["livenessProbe"]["grpc"] == {"port": health_port}
                assert not {"startupProbe", "readinessProbe"} & container.keys()
                continue
            if component not in SERVERS:
                # The evaluator serves nothing: a probe would be meaningless.
                assert not {"startupProbe", "readinessProbe", "livenessProbe"} & container.keys()
                continue
            env = container_env(docs, workload, container, first_pod_name(workload))
            bind_port = int(env[SERVERS[component]].rsplit(":", 1)[1])
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["grpc"] == bind_port
            # Under TLS (the example values) the kubelet probes the plaintext health port the server
            # binds for it; without TLS the gRPC port itself.
            health = env.get(SERVERS[component].replace("_BIND", "_HEALTH_BIND"))
            probe_port = int(health.rsplit(":", 1)[1]) if health else bind_port
            assert bool(health) == load_values(name)["tls"]["enabled"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                # Native gRPC probe on the standard health service, whole server (no service name).
                assert container[probe]["grpc"] == {"port": probe_port}, (component, probe)
            services = [s for s in find(docs, "Service", component=component)]
            assert services, f"no Service for {component}"
            for service in services:
                assert [p["targetPort"] for p in service["spec"]["ports"]] == ["grpc"]
            checked += 1
    expected = int(load_values(name)["syncer"]["enabled"]) + int(load_values(name)["store"]["enabled"])
    assert checked == expected


def test_learner_liveness_probe_allows_the_loop_its_own_bound(render):
    """The learner says NOT_SERVING itself after settings.livenessTimeoutS without progress (which
    covers start-up); the probe only needs a few answers in a row, well inside that bound."""
    from services.learner import config as learner_config

    docs = render("default")
    for sts in learner_sets(docs):
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        env = container_env(docs, sts, container, first_pod_name(sts))
        cfg = learner_config.parse_learner_config([], env)
        probe = container["livenessProbe"]
        assert cfg.health_bind == f"0.0.0.0:{probe['grpc']['port']}"
        assert cfg.liveness_timeout_s == load_values("default")["learners"]["settings"]["livenessTimeoutS"] >= 60
        assert probe["periodSeconds"] * probe["failureThreshold"] < cfg.liveness_timeout_s
        assert probe["timeoutSeconds"] < probe["periodSeconds"]


NODE_FAILURE_TAINTS = {"notReady": "node.kubernetes.io/not-ready", "unreachable": "node.kubernetes.io/unreachable"}


def _node_failure_seconds(pod: dict) -> dict[str, int | None]:
    found = {}
    for toleration in pod.get("tolerations", []):
        for key, taint in NODE_FAILURE_TAINTS.items():
            if toleration["key"] == taint:
                assert toleration["operator"] == "Exists" and toleration["effect"] == "NoExecute", toleration
                assert key not in found, f"two tolerations for {taint}"
                found[key] = toleration.get("tolerationSeconds")
    return found


@pytest.mark.parametrize("name", ALL_VALUES)
def test_every_pod_tolerates_node_failures_only_briefly(render, name):
    """Without an explicit toleration Kubernetes waits 300 s before evicting pods from a failed
    node; every workload pod sets the chart's shorter, configurable bound (values.yaml says why)."""
    values = load_values(name)["nodeFailureTolerationSeconds"]
    assert 0 < values["notReady"] < 300 and 0 < values["unreachable"] < 300
    docs = render(name)
    pods = [(n, pod) for n, _meta, pod in pod_specs(docs) if n in {w["metadata"]["name"] for w in workloads(docs)}]
    assert pods
    for pod_name, pod in pods:
        assert _node_failure_seconds(pod) == values, pod_name


def test_node_failure_tolerations_are_configurable_and_keep_component_tolerations(render, k8s_versions):
    docs = render("default", "--set", "nodeFailureTolerationSeconds.notReady=60",
                  "--set", "nodeFailureTolerationSeconds.unreachable=null",
                  "--set", "syncer.tolerations[0].key=dedicated", "--set", "syncer.tolerations[0].operator=Exists")
    assert not validate_strictly(docs, k8s_versions)
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        # null leaves the unreachable taint to Kubernetes' default (its admission plugin adds 300 s).
        assert _node_failure_seconds(pod) == {"notReady": 60}, workload["metadata"]["name"]
    syncer_pod = one(docs, "Deployment", "syncer")["spec"]["template"]["spec"]
    assert {"key": "dedicated", "operator": "Exists"} in syncer_pod["tolerations"]


def test_syncer_restore_and_shutdown_budgets(render):
    docs = render("hub")
    values = load_values("hub")["syncer"]
    deployment = one(docs, "Deployment", "syncer")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = container_env(docs, deployment, container, first_pod_name(deployment))
    grace, ckpt = float(env["DDILOCO_SYNCER_GRACE_S"]), float(env["DDILOCO_SYNCER_CHECKPOINT_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > grace + 2 * ckpt
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > float(env["DDILOCO_SYNCER_RESTORE_TIMEOUT_S"])
    # The syncer restores from this release's store (its stable pod name behind the headless Service).
    store_sts = one(docs, "StatefulSet", "store")
    store_host = f"{store_sts['metadata']['name']}-0.{store_sts['spec']['serviceName']}"
    assert env["DDILOCO_SYNCER_CHECKPOINT_TARGET"] == f"{store_host}:{load_values('hub')['store']['port']}"
    assert env["DDILOCO_SYNCER_RUN_ID"] == load_values("hub")["run"]["id"]
    pdb = one(docs, "PodDisruptionBudget", "syncer")
    assert selects(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] == values["podDisruptionBudget"]["maxUnavailable"]


def test_syncer_replicas_with_leader_election_roll_one_at_a_time(render, k8s_versions):
    """syncer.replicas > 1 with settings.coordEtcd (docs/failover.md): the pods get the etcd
    endpoints, and a rollout replaces them one at a time (a standby is up before the leader goes)."""
    docs = render("hub", "--set", "syncer.replicas=2", "--set", "syncer.settings.coordEtcd=etcd-0.etcd:2379\\,etcd-1.etcd:2379",
                  "--set", "syncer.settings.coordLeaseS=5")
    problems = validate_strictly(docs, k8s_versions)
    assert not problems, "\n".join(problems)
    deployment = one(docs, "Deployment", "syncer")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = container_env(docs, deployment, container, first_pod_name(deployment))
    assert env["DDILOCO_SYNCER_COORD_ETCD"] == "etcd-0.etcd:2379,etcd-1.etcd:2379"
    assert env["DDILOCO_SYNCER_COORD_LEASE_S"] == "5"


def test_store_volume_is_persistent(render):
    docs = render("hub")
    values = load_values("hub")["store"]
    sts = one(docs, "StatefulSet", "store")
    assert sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == values["persistence"]["size"]
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"
    pod = sts["spec"]["template"]["spec"]
    assert claim["metadata"]["name"] not in {v["name"] for v in pod.get("volumes", [])}, "claim shadowed by a volume"
    (container,) = pod["containers"]
    env = container_env(docs, sts, container, first_pod_name(sts))
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == env["DDILOCO_CHECKPOINT_ROOT"] == values["root"]
    (headless,) = find(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert selects({"matchLabels": headless["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("name", ALL_VALUES)
def test_rendered_env_is_accepted_by_the_services(render, name):
    """Each container's environment parses with the service's own configuration parser."""
    from services.checkpoint import config as checkpoint_config
    from services.learner import config as learner_config
    from services.syncer import config as syncer_config

    parsers = {
        "syncer": syncer_config.parse_config,
        "learner": learner_config.parse_learner_config,
        "evaluate": learner_config.parse_evaluator_config,
        "checkpoint": checkpoint_config.parse_config,
    }
    docs = render(name)
    seen = set()
    for workload in workloads(docs):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            (command,) = container["args"]
            env = container_env(docs, workload, container, first_pod_name(workload))
            cfg = parsers[command]([], env)  # exits (SystemExit) on any invalid variable
            for choice in ("server_security", "client_security"):
                if hasattr(cfg, choice):  # the transport must be chosen (TLS or explicit plaintext)
                    getattr(cfg, choice)()
            seen.add(command)
            if command == "learner":
                assert cfg.learner_id == workload["metadata"]["name"]
                assert cfg.resolved_shard_index == learner_ordinal(workload)
    values = load_values(name)
    assert ("learner" in seen) == values["learners"]["enabled"]
    assert ("syncer" in seen) == values["syncer"]["enabled"]


@pytest.mark.parametrize("name", ALL_VALUES)
def test_pods_run_non_root_with_read_only_root_filesystems(render, name):
    for pod_name, _meta, pod in pod_specs(render(name)):
        assert pod["securityContext"]["runAsNonRoot"] is True, pod_name
        assert pod["automountServiceAccountToken"] is False, pod_name
        tmp_volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, pod_name
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert any(m["mountPath"] == "/tmp" and m["name"] in tmp_volumes for m in container["volumeMounts"])
            assert "requests" in container["resources"], pod_name


@pytest.mark.parametrize("name", ALL_VALUES)
def test_every_resource_carries_the_recommended_labels(render, name):
    for doc in render(name):
        labels = doc["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of", "helm.sh/chart"):
            assert key in labels, f"{doc['kind']}/{doc['metadata']['name']} lacks {key}"
        if doc["kind"] in ("Deployment", "StatefulSet", "Service", "ConfigMap", "NetworkPolicy", "Pod"):
            assert "app.kubernetes.io/component" in labels


def test_credentials_secret_or_existing_secret_is_mounted_read_only(render, k8s_versions):
    created = render("default", "--set", "credentials.create=true", "--set-string", "credentials.stringData.ca\\.crt=x")
    existing = render("default", "--set", "credentials.existingSecret=my-tls")
    assert not validate_strictly(created, k8s_versions)
    (secret,) = find(created, "Secret")
    assert secret["stringData"] == {"ca.crt": "x"}
    assert not find(existing, "Secret")
    for docs, secret_name in ((created, secret["metadata"]["name"]), (existing, "my-tls")):
        for pod_name, _meta, pod in pod_specs(docs):
            if pod_name.endswith("test-connection"):
                continue
            (volume,) = [v for v in pod["volumes"] if v["name"] == "credentials"]
            assert volume["secret"]["secretName"] == secret_name
            for container in pod["containers"]:
                (mount,) = [m for m in container["volumeMounts"] if m["name"] == "credentials"]
                assert mount["readOnly"] is True and mount["mountPath"] == "/etc/ddiloco/credentials"
    assert not find(render("default"), "Secret"), "no Secret unless asked for"


def test_gpu_learners_request_devices_select_gpu_nodes_and_the_jax_backend(render, k8s_versions):
    docs = render("hub", "--set", "learners.gpu.enabled=true", "--set", "learners.gpu.count=4",
                  "--set", "learners.gpu.nodeSelector.cloud\\.google\\.com/gke-accelerator=nvidia-l4",
                  "--set", "learners.nodeSelector.pool=train")
    assert not validate_strictly(docs, k8s_versions)
    sts = learner_sets(docs)[0]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    values = load_values("hub")["learners"]
    assert container["resources"]["limits"] == {**values["resources"]["limits"], "nvidia.com/gpu": 4}
    assert container["resources"]["requests"] == values["resources"]["requests"]
    assert container_env(docs, sts, container, first_pod_name(sts))["JAX_PLATFORMS"] == "cuda"
    assert pod["nodeSelector"] == {"pool": "train", "cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # Only learners get GPUs; and nothing changes unless asked for.
    for workload in workloads(docs):
        if workload not in learner_sets(docs):
            assert "nvidia.com/gpu" not in str(workload["spec"]["template"]["spec"])
    plain = learner_sets(render("hub"))[0]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in json.dumps(plain["containers"][0]["resources"])
    assert {t["key"] for t in plain["tolerations"]} == set(NODE_FAILURE_TAINTS.values())  # node failures only
    assert "JAX_PLATFORMS" not in json.dumps(plain["containers"][0]["env"])
    amd = learner_sets(render("hub", "--set", "learners.gpu.enabled=true",
                              "--set", "learners.gpu.resourceName=amd.com/gpu"))[0]["spec"]["template"]["spec"]["containers"][0]
    assert amd["resources"]["limits"]["amd.com/gpu"] == 1


def test_gpu_learners_may_use_their_own_image_and_need_a_divisible_batch(render, tools, tmp_path):
    sts = learner_sets(render("hub", "--set", "learners.gpu.enabled=true", "--set", "learners.gpu.image.repository=reg/ddiloco",
                              "--set", "learners.gpu.image.tag=0.1.0-cuda12"))[0]
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/ddiloco:0.1.0-cuda12"
    syncer = one(render("hub", "--set", "learners.gpu.enabled=true", "--set", "learners.gpu.image.repository=reg/x"),
                 "Deployment", "syncer")
    assert syncer["spec"]["template"]["spec"]["containers"][0]["image"].startswith("ddiloco:")  # CPU image
    bad = tmp_path / "gpu.yaml"
    bad.write_text(json.dumps({"learners": {"gpu": {"enabled": True, "count": 3}}}))  # batchSize 16
    proc = tools.helm_run("template", "ddiloco", str(CHART), "--values", str(bad), check=False)
    assert proc.returncode != 0 and "not divisible by learners.gpu.count=3" in proc.stderr, proc.stderr


def test_store_replicas_are_spread_over_zones_and_all_replicated_to(render, k8s_versions):
    """store.replicas=3: one StatefulSet of 3 pods (a volume each) spread over zones, and the syncer
    writes every checkpoint to the 3 stable pod names."""
    docs = render("default", "--set", "store.replicas=3")
    problems = validate_strictly(docs, k8s_versions)
    assert not problems, "\n".join(problems)
    store = one(docs, "StatefulSet", "store")
    assert store["spec"]["replicas"] == 3
    (spread,) = store["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    syncer = one(docs, "Deployment", "syncer")
    (container,) = syncer["spec"]["template"]["spec"]["containers"]
    env = container_env(docs, syncer, container, first_pod_name(syncer))
    assert env["DDILOCO_SYNCER_CHECKPOINT_TARGET"] == ",".join(
        f"ddiloco-store-{i}.ddiloco-store:50052" for i in range(3))
    single = one(render("default"), "StatefulSet", "store")
    assert single["spec"]["replicas"] == 1 and "topologySpreadConstraints" not in single["spec"]["template"]["spec"]
