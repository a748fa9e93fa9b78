"""The Helm chart and the kustomize tree, checked offline with real helm and kubectl binaries.

Lint and render every values file; validate every manifest strictly against the Kubernetes
schemas (1.30 and the newest kubernetes-validate ships); build every kustomize overlay and check it
equals the chart's render; then semantic checks that catch real deployment mistakes: a region's
learners pointing elsewhere than the hub, probes on the wrong port, a store without a persistent
volume, NetworkPolicies admitting more (or less) than the intended paths, a values schema that
drifted from the services' flags, a pod that can read another component's TLS key, plaintext gRPC
leaving the cluster without the explicit opt-in.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
import sys

import pytest

from tests.k8s.conftest import (
    CHART,
    K8S,
    NAMESPACE,
    OVERLAYS,
    RELEASE,
    ROOT,
    VALUES,
    load_docs,
    load_values,
    validate_strictly,
)

ALL_VALUES = list(VALUES)
SERVERS = {"syncer": "DDILOCO_SYNCER_BIND", "store": "DDILOCO_CHECKPOINT_BIND"}


# ---------------------------------------------------------------------------------------------
# Helpers over rendered manifests


def find(docs, kind: str, name: str | None = None, component: str | None = None) -> list[dict]:
    out = []
    for doc in docs:
        if doc["kind"] != kind:
            continue
        if name is not None and doc["metadata"]["name"] != name:
            continue
        if component is not None and doc["metadata"]["labels"].get("app.kubernetes.io/component") != component:
            continue
        out.append(doc)
    return out


def one(docs, kind: str, component: str) -> dict:
    found = find(docs, kind, component=component)
    assert len(found) == 1, f"expected one {kind} of component {component}, found {len(found)}"
    return found[0]


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def learner_ordinal(sts: dict) -> int:
    """A learner's ordinal: the number its StatefulSet (<fullname>-learner-<ordinal>) ends in."""
    return int(sts["metadata"]["name"].rsplit("-", 1)[1])


def learner_sets(docs) -> list[dict]:
    """The learners' StatefulSets (one single-pod StatefulSet per learner), by ordinal."""
    return sorted(find(docs, "StatefulSet", component="learner"), key=learner_ordinal)


def pod_specs(docs) -> list[tuple[str, dict, dict]]:
    """(name, pod metadata, pod spec) of every workload's pod template and of bare pods."""
    out = [(d["metadata"]["name"], d["spec"]["template"]["metadata"], d["spec"]["template"]["spec"])
           for d in workloads(docs)]
    out += [(d["metadata"]["name"], d["metadata"], d["spec"]) for d in docs if d["kind"] == "Pod"]
    return out


def container_env(docs, workload: dict, container: dict, pod_name: str) -> dict[str, str]:
    """The environment a container gets: envFrom ConfigMaps, then env (fieldRef metadata.name resolved)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        (cm,) = find(docs, "ConfigMap", source["configMapRef"]["name"])
        env.update(cm.get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            # $(NAME) refers to a variable defined before it (Kubernetes dependent variables).
            env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), var["value"])
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            env[var["name"]] = pod_name
    return env


def first_pod_name(workload: dict) -> str:
    start = workload["spec"].get("ordinals", {}).get("start", 0) if workload["kind"] == "StatefulSet" else 0
    return f"{workload['metadata']['name']}-{start}"


def selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        present, value = expr["key"] in labels, labels.get(expr["key"])
        op = expr["operator"]
        if (op == "In" and value not in expr["values"]) or (op == "NotIn" and value in expr["values"]):
            return False
        if (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# helm lint, helm template, strict schema validation, kustomize


@pytest.mark.parametrize("name", ALL_VALUES)
def test_helm_lint_strict(tools, name):
    args = ["lint", "--strict", str(CHART)]
    if VALUES[name] is not None:
        args += ["--values", str(VALUES[name])]
    out = tools.helm_run(*args).stdout
    assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize("name", ALL_VALUES)
def test_rendered_manifests_validate_strictly(render, k8s_versions, name):
    docs = render(name)
    assert docs, f"helm template rendered nothing for {name}"
    assert "1.30.0" in k8s_versions and len(k8s_versions) >= 2
    problems = validate_strictly(docs, k8s_versions)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_kustomize_builds_validate_and_equal_the_chart(tools, render, k8s_versions, overlay):
    path = K8S / "kustomize" / ("base" if overlay == "base" else f"overlays/{overlay}")
    built = load_docs(tools.kubectl_run("kustomize", str(path)).stdout)
    problems = validate_strictly(built, k8s_versions)
    assert not problems, "\n".join(problems)

    def keyed(docs):
        return {(d["apiVersion"], d["kind"], d["metadata"]["name"]): d for d in docs}

    chart = keyed(render("default" if overlay == "base" else overlay, tests=False))
    kustomized = keyed(built)
    assert kustomized.keys() == chart.keys(), f"kubectl kustomize {path} and helm template differ in resources"
    for key in chart:
        assert kustomized[key] == chart[key], f"{key} differs between kustomize and helm: run `make k8s-render`"


@pytest.mark.parametrize(
    "settings",
    [
        ["networkPolicy.enabled=false", "serviceAccount.create=false", "evaluator.enabled=false"],
        ["store.enabled=false", "syncer.checkpointTarget=store.example.com:50052",
         "syncer.networkPolicy.extraTo[0].ipBlock.cidr=192.0.2.0/24", "syncer.service.type=NodePort",
         "tls.allowPlaintextBeyondCluster=true"],
        ["metrics.enabled=true", "learners.replicas=0", "fullnameOverride=train",
         "store.persistence.storageClassName=ssd", "imagePullSecrets[0].name=regcred"],
    ],
    ids=["minimal", "external-store", "metrics-no-learners"],
)
def test_other_value_combinations_render_valid_manifests(render, k8s_versions, settings):
    extra = tuple(arg for setting in settings for arg in ("--set", setting))
    docs = render("default", *extra)
    problems = validate_strictly(docs, k8s_versions)
    assert not problems, "\n".join(problems)


def test_kustomize_tree_is_fresh(tools):
    proc = tools.run(sys.executable, str(ROOT / "scripts" / "render_k8s.py"), "--check", "--helm", tools.helm,
                     check=False)
    assert proc.returncode == 0, proc.stderr or "k8s/kustomize is stale: run `make k8s-render`"


def test_helm_install_dry_run_notes_tell_how_to_watch(tools):
    out = tools.helm_run("install", "ddiloco", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                         "--values", str(VALUES["hub"])).stdout
    notes = out.split("NOTES:", 1)[1]
    assert "ddiloco status --watch --target 127.0.0.1:50051" in notes
    assert "kubectl -n ddiloco port-forward svc/ddiloco-syncer 50051:50051" in notes
    region = tools.helm_run("install", "ddiloco", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                            "--values", str(VALUES["region-a"])).stdout
    assert "syncing with syncer.hub.example.com:50051" in region.split("NOTES:", 1)[1]
    tls = tools.helm_run("install", "ddiloco", str(CHART), "--dry-run=client", "--namespace", NAMESPACE,
                         "--values", str(VALUES["hub"]), "--set", "tls.enabled=true",
                         "--set", "tls.existingSecret=ddiloco-tls").stdout.split("NOTES:", 1)[1]
    assert "--tls-cert operator.pem --tls-key operator.key --tls-server-name syncer" in tls
    assert "exec -it deploy" not in tls  # the syncer's own certificate may not read the state


# ---------------------------------------------------------------------------------------------
# The values schema


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"learners": {"replicas": "two"}}, "/learners/replicas"),
        ({"leaners": {"replicas": 2}}, "leaners"),  # a typo is an error, not a silently ignored key
        ({"syncer": {"settings": {"bind": "0.0.0.0:1"}}}, "bind"),  # wired by the chart
        ({"syncer": {"settings": {"uploadCodec": "int3"}}}, "uploadCodec"),
        ({"hub": {"syncerAddress": "https://hub:50051"}}, "syncerAddress"),
        ({"store": {"port": 70000}}, "/store/port"),
        ({"tls": {"enabled": True}}, "existingSecret"),  # mutual TLS needs the certificates
        ({"tls": {"allowPlaintextBeyondCluster": "yes"}}, "/tls/allowPlaintextBeyondCluster"),
        ({"learners": {"gpu": {"count": 0}}}, "/learners/gpu/count"),
    ],
)
def test_schema_rejects_bad_values(tools, tmp_path, values, complaint):
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(json.dumps(values))
    for command in (["lint", "--strict"], ["template", "ddiloco"]):
        proc = tools.helm_run(*command, str(CHART), "--values", str(bad), check=False)
        assert proc.returncode != 0, f"helm {command[0]} accepted {values}"
        assert complaint in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"syncer": {"enabled": False}}, "hub.syncerAddress is empty"),
        ({"learners": {"ordinalStart": 1}}, "exceeds data.numShards"),
        ({"store": {"enabled": False}}, "the syncer needs a checkpoint store"),
        ({"syncer": {"terminationGracePeriodSeconds": 20}}, "too short"),
        ({"syncer": {"startupProbe": {"failureThreshold": 2}}}, "startupProbe"),
        ({"fullnameOverride": "a" * 45}, "learner StatefulSet name"),  # its pods could never be created
        ({"syncer": {"replicas": 2}}, "needs leader election"),  # two syncers merging: two outer steps
    ],
)
def test_template_refuses_inconsistent_values(tools, tmp_path, values, complaint):
    bad = tmp_path / "inconsistent-values.yaml"
    bad.write_text(json.dumps(values))
    proc = tools.helm_run("template", "ddiloco", str(CHART), "--values", str(bad), check=False)
    assert proc.returncode != 0 and complaint in proc.stderr, proc.stderr


def _render_script():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import render_k8s
    finally:
        sys.path.pop(0)
    return render_k8s


def test_settings_cover_every_flag_and_wired_flags_are_wired(render):
    """Every flag of a service is either a `settings` key (schema), wired by the chart, or unsupported;
    and the flags said to be wired really are set in the rendered containers."""
    render_k8s = _render_script()
    schema = json.loads((CHART / "values.schema.json").read_text())
    prefixes = {"syncer": "DDILOCO_SYNCER_", "store": "DDILOCO_CHECKPOINT_", "learners": "DDILOCO_LEARNER_",
                "evaluator": "DDILOCO_EVAL_"}
    # The plaintext wiring (insecure) too: the hub file turns TLS on, so turn it off explicitly.
    docs = render("hub", "--set", "tls.enabled=false", "--set", "tls.allowPlaintextBeyondCluster=true")
    tls_docs = render("hub", "--set", "tls.enabled=true", "--set", "tls.existingSecret=ddiloco-tls")
    for component, cls in render_k8s.service_configs().items():
        wired, unsupported = set(render_k8s.WIRED[component]), render_k8s.UNSUPPORTED[component]
        wired_tls = render_k8s.WIRED_TLS[component]
        assert not (wired | wired_tls) & unsupported
        fields = {f.name for f in dataclasses.fields(cls)}
        settings = set(schema["properties"][component]["properties"]["settings"]["properties"])
        expected = {render_k8s.camel(f) for f in fields - wired - wired_tls - unsupported}
        assert settings == expected, f"{component}.settings drifted from {cls.__name__}: run `make k8s-render`"
        assert wired_tls <= fields, f"{component}: WIRED_TLS names flags {cls.__name__} does not have"
        for rendered, names in ((docs, wired), (tls_docs, wired_tls)):
            workload = (learner_sets(rendered)[0] if component == "learners" else
                        one(rendered, "StatefulSet" if component == "store" else "Deployment", component))
            (container,) = workload["spec"]["template"]["spec"]["containers"]
            env = container_env(rendered, workload, container, first_pod_name(workload))
            for name in names & fields:
                assert prefixes[component] + name.upper() in env, f"{component}: the chart does not set {name}"


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


# ---------------------------------------------------------------------------------------------
# NetworkPolicies: evaluate them, as a CNI would, over every pair of endpoints


@dataclasses.dataclass(frozen=True)
class Endpoint:
    name: str
    labels: dict = dataclasses.field(default_factory=dict)
    namespace: str | None = NAMESPACE  # None: outside the cluster
    ip: str = "10.0.0.1"


KUBE_DNS = Endpoint("kube-dns", {"k8s-app": "kube-dns"}, "kube-system", "10.96.0.10")
STRANGER = Endpoint("stranger", {"app": "something-else"})  # any other pod of the namespace
INTERNET = Endpoint("internet", namespace=None, ip="8.8.8.8")
SCRAPER = Endpoint("prometheus", {"app.kubernetes.io/name": "prometheus"}, "monitoring", "10.0.9.9")


def _peer_matches(peer: dict, policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        addr = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return addr in ipaddress.ip_network(block["cidr"]) and not any(
            addr in ipaddress.ip_network(c) for c in block.get("except", []))
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        ns_ok = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": other.namespace})
    else:
        ns_ok = other.namespace == policy_ns
    return ns_ok and selects(peer.get("podSelector", {}), other.labels)


def _rule_admits(rule: dict, direction: str, policy_ns: str, other: Endpoint, port: int, protocol: str) -> bool:
    peers = rule.get("from" if direction == "ingress" else "to")
    if peers and not any(_peer_matches(p, policy_ns, other) for p in peers):
        return False
    ports = rule.get("ports")
    return not ports or any(p.get("protocol", "TCP") == protocol and p.get("port") == port for p in ports)


def _side_allows(policies, me: Endpoint, direction: str, other: Endpoint, port: int, protocol: str) -> bool:
    if me.namespace is None:
        return True  # not in this cluster: its policies are not ours
    kind = "Ingress" if direction == "ingress" else "Egress"
    applying = [p for p in policies if p["metadata"]["namespace"] == me.namespace and kind in p["spec"]["policyTypes"]
                and selects(p["spec"]["podSelector"], me.labels)]
    if not applying:
        return True
    return any(_rule_admits(rule, direction, p["metadata"]["namespace"], other, port, protocol)
               for p in applying for rule in p["spec"].get(direction) or [])


def allowed(policies, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    return (_side_allows(policies, src, "egress", dst, port, protocol)
            and _side_allows(policies, dst, "ingress", src, port, protocol))


def _endpoints(docs) -> dict[str, Endpoint]:
    out = {}
    for workload in workloads(docs):
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        out[component] = Endpoint(component, workload["spec"]["template"]["metadata"]["labels"])
    return out


def test_network_policies_of_the_hub_allow_exactly_the_intended_paths(render):
    docs = render("hub")
    values = load_values("hub")
    policies = find(docs, "NetworkPolicy")
    assert all(set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"} for p in policies)
    pods = _endpoints(docs)
    assert set(pods) == {"store", "syncer", "learner", "evaluator"}
    store_port, syncer_port = values["store"]["port"], values["syncer"]["port"]
    everyone = [*pods.values(), STRANGER, KUBE_DNS, INTERNET, SCRAPER]
    region_a = Endpoint("region-a-learner", namespace=None, ip="198.51.100.7")

    # Only the syncer reaches the store, and only on its port; the store reaches nothing.
    for src in everyone:
        assert allowed(policies, src, pods["store"], store_port) == (src.name == "syncer"), src.name
    assert not allowed(policies, pods["syncer"], pods["store"], 22)
    for dst in everyone:
        assert not allowed(policies, pods["store"], dst, 53, "UDP") and not allowed(policies, pods["store"], dst, 443)

    # The syncer admits its clients (this region's learners and evaluator, other regions through
    # the allowed CIDRs) on its port, nothing else; it dials only the store and DNS.
    for src in [*everyone, region_a]:
        expected = src.name in ("learner", "evaluator", "region-a-learner")
        assert allowed(policies, src, pods["syncer"], syncer_port) == expected, src.name
    assert not allowed(policies, pods["learner"], pods["syncer"], 8080)
    assert allowed(policies, pods["syncer"], KUBE_DNS, 53, "UDP")
    assert not allowed(policies, pods["syncer"], INTERNET, 443)
    assert not allowed(policies, pods["syncer"], pods["learner"], syncer_port)

    # Learners and the evaluator accept nothing, and reach only the syncer (and DNS): not the store.
    for client in ("learner", "evaluator"):
        for src in everyone:
            assert not allowed(policies, src, pods[client], 8080), (src.name, client)
            assert not allowed(policies, src, pods[client], syncer_port), (src.name, client)
        for dst in everyone:
            for port, protocol in ((store_port, "TCP"), (syncer_port, "TCP"), (53, "UDP"), (443, "TCP")):
                expected = (dst.name == "syncer" and port == syncer_port) or (dst is KUBE_DNS and port == 53)
                assert allowed(policies, pods[client], dst, port, protocol) == expected, (client, dst.name, port)


    # Prometheus (metrics.from: the monitoring namespace) scrapes the metrics ports, nothing else.
    metrics = values["metrics"]["ports"]
    assert values["metrics"]["enabled"]
    for component, port in (("syncer", metrics["syncer"]), ("store", metrics["store"]), ("learner", metrics["learner"])):
        assert allowed(policies, SCRAPER, pods[component], port), component
        for src in everyone:
            if src is not SCRAPER:
                assert not allowed(policies, src, pods[component], port), (src.name, component)
    assert not allowed(policies, SCRAPER, pods["evaluator"], metrics["learner"])


def test_metrics_ports_are_wired_consistently(render):
    docs = render("hub")
    checked = set()
    for workload in workloads(docs):
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        template = workload["spec"]["template"]
        (container,) = template["spec"]["containers"]
        env = container_env(docs, workload, container, first_pod_name(workload))
        binds = [v for k, v in env.items() if k.endswith("_METRICS_BIND")]
        if component == "evaluator":
            assert not binds and "prometheus.io/port" not in template["metadata"]["annotations"]
            continue
        (bind,) = binds
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = int(bind.rsplit(":", 1)[1])
        assert ports["metrics"] == port == int(template["metadata"]["annotations"]["prometheus.io/port"])
        assert port != ports.get("grpc")
        checked.add(component)
    assert checked == {"syncer", "store", "learner"}
    # Off by default: no metrics port, variable or scrape annotation anywhere.
    for workload in workloads(render("default")):
        template = workload["spec"]["template"]
        assert "prometheus.io/scrape" not in template["metadata"]["annotations"]
        for container in template["spec"]["containers"]:
            assert "metrics" not in {p["name"] for p in container.get("ports", [])}
            assert not [v for v in container["env"] if v["name"].endswith("_METRICS_BIND")]


@pytest.mark.parametrize("name", ["region-a", "region-b"])
def test_network_policies_of_a_region_allow_only_the_hub_syncer(render, name):
    docs = render(name)
    values = load_values(name)
    policies = find(docs, "NetworkPolicy")
    pods = _endpoints(docs)
    assert set(pods) == {"learner"}
    port = int(values["hub"]["syncerAddress"].rsplit(":", 1)[1])
    hub = Endpoint("hub-syncer", namespace=None, ip=str(ipaddress.ip_network(
        values["learners"]["networkPolicy"]["syncerCIDRs"][0])[0]))
    learner = pods["learner"]
    assert allowed(policies, learner, hub, port)
    assert not allowed(policies, learner, hub, 443)
    assert not allowed(policies, learner, INTERNET, port)
    assert allowed(policies, learner, KUBE_DNS, 53, "UDP") and allowed(policies, learner, KUBE_DNS, 53, "TCP")
    assert not allowed(policies, learner, STRANGER, port)
    for src in (STRANGER, KUBE_DNS, INTERNET, hub):
        assert not allowed(policies, src, learner, 8080)
        assert not allowed(policies, src, learner, values["metrics"]["ports"]["learner"])
    assert allowed(policies, SCRAPER, learner, values["metrics"]["ports"]["learner"])
    assert not allowed(policies, SCRAPER, learner, 8080)


def _operator_resource(render, kind: str, values_key: str) -> tuple[list[dict], dict]:
    """The hub's documents with `metrics.<values_key>` enabled and labelled release=prom, and the
    one `kind` resource of the Prometheus operator's API among them, with that label."""
    docs = render("hub", "--set", f"metrics.{values_key}.enabled=true",
                  "--set", f"metrics.{values_key}.labels.release=prom", tests=False)
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1
    assert found[0]["apiVersion"] == "monitoring.coreos.com/v1"
    assert found[0]["metadata"]["labels"]["release"] == "prom"
    return docs, found[0]


def test_optional_service_monitor_scrapes_every_metrics_port(render, k8s_versions):
    docs, monitor = _operator_resource(render, "ServiceMonitor", "serviceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    services = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics")]
    assert len(services) == 1
    service = services[0]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    # The Service selects every pod that names a container port "metrics" (syncer, store, learners).
    pods = [d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    with_metrics = [
        t for t in pods
        if any(p.get("name") == "metrics" for c in t["spec"]["containers"] for p in c.get("ports", []))
    ]
    assert len(with_metrics) >= 3
    for template in with_metrics:
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    # Everything except the CRD-typed ServiceMonitor validates against the Kubernetes schemas.
    assert not validate_strictly([d for d in docs if d["kind"] != "ServiceMonitor"], k8s_versions)
    # Off unless asked for.
    assert not [d for d in render("hub", tests=False) if d["kind"] == "ServiceMonitor"]


def test_optional_prometheus_rule_is_exactly_the_rules_file(render, k8s_versions):
    import yaml

    # One source of truth: the PrometheusRule's spec is the plain rules file compose loads, which
    # tests/unit/test_prometheus_rules.py checks with promtool; the chart holds a link to it.
    source = ROOT / "deploy" / "prometheus" / "rules.yml"
    assert (CHART / "files" / "prometheus-rules.yml").resolve() == source.resolve()
    rules = yaml.safe_load(source.read_text())
    docs, rule = _operator_resource(render, "PrometheusRule", "prometheusRule")
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert rule["spec"] == rules
    # The alerts' own templates reach Prometheus untouched by Helm.
    assert "{{ $labels.instance }}" in json.dumps(rule["spec"])
    assert not validate_strictly([d for d in docs if d["kind"] != "PrometheusRule"], k8s_versions)
    # Off unless asked for; never in a release without the syncer (its metrics are what the rules read).
    assert not [d for d in render("hub", tests=False) if d["kind"] == "PrometheusRule"]
    region = render("region-a", "--set", "metrics.prometheusRule.enabled=true", tests=False)
    assert not [d for d in region if d["kind"] == "PrometheusRule"]


# ---------------------------------------------------------------------------------------------
# Mutual TLS and GPUs (off by default)

TLS_SET = ("--set", "tls.enabled=true", "--set", "tls.existingSecret=ddiloco-tls",
           "--set", "tls.learnersSecret=ddiloco-learner-tls")


@pytest.mark.parametrize("name", ["hub", "region-a"])
def test_mutual_tls_wires_certificates_server_names_and_health_probes(render, k8s_versions, name):
    """tls.enabled: every component parses to mutual TLS with its own certificate from the mounted
    Secret (learners: the one named after them), every pod mounts only its own files, servers are
    probed on a plaintext health port that their HEALTH_BIND serves, and `helm test` reads with the
    read-only credential."""
    from services.checkpoint import config as checkpoint_config
    from services.learner import config as learner_config
    from services.syncer import config as syncer_config

    docs = render(name, *TLS_SET)
    assert not validate_strictly(docs, k8s_versions)
    mount = "/etc/ddiloco/tls"
    parsers = {"syncer": syncer_config.parse_config, "learner": learner_config.parse_learner_config,
               "evaluate": learner_config.parse_evaluator_config, "checkpoint": checkpoint_config.parse_config}
    identity = {"syncer": "syncer", "checkpoint": "checkpoint", "evaluate": "evaluator"}
    health = {"syncer": 8081, "checkpoint": 8082}
    seen = set()
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        (command,) = container["args"]
        pod_name = first_pod_name(workload)
        env = container_env(docs, workload, container, pod_name)
        cfg = parsers[command]([], env)
        seen.add(command)
        stem = workload["metadata"]["name"] if command == "learner" else identity[command]  # learner id
        assert (cfg.tls_ca, cfg.tls_cert, cfg.tls_key) == (f"{mount}/ca.pem", f"{mount}/{stem}.pem", f"{mount}/{stem}.key")
        assert not cfg.insecure
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        (tls_mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert tls_mount == {"name": "tls", "mountPath": mount, "readOnly": True}
        # Every pod sees ca.pem and its own pair only (learners from their own Secret).
        assert volume["secret"]["secretName"] == ("ddiloco-learner-tls" if command == "learner" else "ddiloco-tls")
        assert sorted(i["path"] for i in volume["secret"]["items"]) == sorted(["ca.pem", f"{stem}.pem", f"{stem}.key"])
        if command == "learner":
            assert cfg.tls_server_name == "syncer"
            continue
        if command == "evaluate":
            assert cfg.tls_server_name == "syncer"
            continue
        cfg.server_security()  # mutual TLS fully configured
        assert cfg.health_bind == f"0.0.0.0:{health[command]}"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["health"] == health[command] != ports["grpc"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": health[command]}, (command, probe)
        if command == "syncer":
            assert cfg.checkpoint_tls_server_name == "checkpoint"
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        for service in find(docs, "Service", component=component):
            assert all("appProtocol" not in p for p in service["spec"]["ports"])  # not h2c any more
    assert "learner" in seen
    (test_pod,) = [d for d in docs if d["kind"] == "Pod"]
    args = test_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--tls-cert") + 1] == f"{mount}/operator.pem"
    assert args[args.index("--tls-server-name") + 1] == "syncer"
    (volume,) = [v for v in test_pod["spec"]["volumes"] if v["name"] == "tls"]
    assert sorted(i["path"] for i in volume["secret"]["items"]) == ["ca.pem", "operator.key", "operator.pem"]
    # Without tls.enabled nothing of it is rendered (a region needs the opt-in to dial the hub in plaintext).
    plain = render(name, "--set", "tls.enabled=false", "--set", "tls.allowPlaintextBeyondCluster=true")
    assert not [v for _n, _m, pod in pod_specs(plain) for v in pod["volumes"] if v["name"] == "tls"]


# ---------------------------------------------------------------------------------------------
# Keys only where they belong, and no plaintext beyond the cluster unless asked for


def secret_keys(pod: dict) -> set[tuple[str, str]]:
    """(Secret, key) of every Secret key a pod's volumes expose; a Secret mounted without `items`
    is (name, "*"): all of its keys, including any added later."""
    out = set()
    for volume in pod.get("volumes", []):
        sources = [volume["secret"]] if "secret" in volume else []
        sources += [src["secret"] for src in volume.get("projected", {}).get("sources", []) if "secret" in src]
        for source in sources:
            name = source.get("secretName", source.get("name"))
            out |= {(name, item["key"]) for item in source["items"]} if source.get("items") else {(name, "*")}
    return out


@pytest.mark.parametrize(
    "name, extra, learners_secret",
    [
        ("hub", (), "ddiloco-tls"),
        ("region-a", (), "ddiloco-tls"),
        ("hub", ("--set", "tls.learnersSecret=ddiloco-learner-tls"), "ddiloco-learner-tls"),
    ],
    ids=["hub", "region-a", "hub-learners-secret"],
)
def test_every_pod_mounts_only_the_ca_and_its_own_pair(render, name, extra, learners_secret):
    """The TLS Secret holds every component's key (and every learner's): each pod must see ca.pem and
    its own <name>.pem/.key only, never the syncer's, the store's or another learner's key (with it,
    a learner could upload as any learner, or serve as the syncer)."""
    docs = render(name, "--set", "tls.enabled=true", "--set", "tls.existingSecret=ddiloco-tls", *extra)
    values = load_values(name)
    owners = {"syncer": "syncer", "store": "checkpoint", "evaluator": "evaluator", "test": "operator"}
    pods = [(w, first_pod_name(w), w["spec"]["template"]) for w in workloads(docs)]
    pods += [(d, d["metadata"]["name"], d) for d in docs if d["kind"] == "Pod"]
    learners, components = set(), set()
    for owner_doc, pod_name, pod in pods:
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        components.add(component)
        (container,) = pod["spec"]["containers"]
        if component == "learner":
            owner = container_env(docs, owner_doc, container, pod_name)["DDILOCO_LEARNER_LEARNER_ID"]
            secret = learners_secret
            learners.add(owner)
        else:
            owner, secret = owners[component], "ddiloco-tls"
        visible = secret_keys(pod["spec"])
        expected = {(secret, "ca.pem"), (secret, f"{owner}.pem"), (secret, f"{owner}.key")}
        assert visible == expected, f"{pod_name} ({owner}) can read {sorted(visible - expected)}"
        # ... and the files it is told to use are the ones mounted.
        (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "tls"]
        told = [v for k, v in container_env(docs, owner_doc, container, pod_name).items()
                if k.endswith(("_TLS_CA", "_TLS_CERT", "_TLS_KEY"))] if component != "test" else \
            [a for a in container["args"] if a.startswith(mount)]
        assert sorted(told) == sorted(f"{mount}/{key}" for _secret, key in expected), pod_name
    start, count = values["learners"]["ordinalStart"], values["learners"]["replicas"]
    assert learners == {f"ddiloco-learner-{i}" for i in range(start, start + count)}, "a learner without its own pair"
    assert components == ({"store", "syncer", "evaluator", "learner", "test"} if name == "hub" else {"learner", "test"})


@pytest.mark.parametrize("name", OVERLAYS)
def test_example_values_use_mutual_tls_on_every_connection(render, name):
    """The shipped multi-region values: mutual TLS on every server and client, the hub's public load
    balancer included; nothing asks for plaintext."""
    from services.checkpoint import config as checkpoint_config
    from services.learner import config as learner_config
    from services.syncer import config as syncer_config

    values = load_values(name)
    assert values["tls"]["enabled"] is True and values["tls"]["existingSecret"], f"{name}: tls is off"
    assert not values["tls"].get("allowPlaintextBeyondCluster"), f"{name} opts in to plaintext"
    docs = render(name)
    checks = {
        "syncer": (syncer_config.parse_config, ("server_security", "checkpoint_security")),
        "checkpoint": (checkpoint_config.parse_config, ("server_security",)),
        "learner": (learner_config.parse_learner_config, ("client_security",)),
        "evaluate": (learner_config.parse_evaluator_config, ("client_security",)),
    }
    for workload in workloads(docs):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        (command,) = container["args"]
        env = container_env(docs, workload, container, first_pod_name(workload))
        assert not [k for k in env if k.endswith("_INSECURE")], (workload["metadata"]["name"], "plaintext")
        parse, securities = checks[command]
        cfg = parse([], env)
        assert not cfg.insecure and cfg.tls_ca and cfg.tls_cert and cfg.tls_key, workload["metadata"]["name"]
        for security in securities:
            getattr(cfg, security)()  # mutual TLS fully configured (raises otherwise)
    for service in find(docs, "Service"):
        # h2c is cleartext HTTP/2: it must not be announced for a TLS port.
        assert all(p.get("appProtocol") != "kubernetes.io/h2c" for p in service["spec"].get("ports", [])), service
    if name == "hub":
        assert one(docs, "Service", "syncer")["spec"]["type"] == "LoadBalancer"
    (test_pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert "--tls-ca" in test_pod["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(
    "name, settings, refused",
    [
        ("default", ["syncer.service.type=LoadBalancer"],
         "syncer.service.type=LoadBalancer exposes the syncer outside the cluster"),
        ("default", ["syncer.service.type=NodePort"], "syncer.service.type=NodePort exposes the syncer"),
        ("hub", ["tls.enabled=false"], "syncer.service.type=LoadBalancer exposes the syncer"),
        ("region-a", ["tls.enabled=false"], "hub.syncerAddress=syncer.hub.example.com:50051 is a syncer outside"),
        ("default", ["store.enabled=false", "syncer.checkpointTarget=store.example.com:50052"],
         "syncer.checkpointTarget=store.example.com:50052 is a checkpoint store outside"),
        # A ClusterIP syncer that admits other regions' addresses (e.g. behind a Gateway).
        ("default", ["syncer.networkPolicy.allowedCIDRs={198.51.100.0/24,203.0.113.0/24}"],
         "syncer.networkPolicy.allowedCIDRs=198.51.100.0/24,203.0.113.0/24 admits clients from outside"),
    ],
    ids=["load-balancer", "node-port", "hub-without-tls", "region-without-tls", "external-store",
         "external-clients"],
)
def test_plaintext_beyond_the_cluster_needs_the_explicit_opt_in(tools, render, k8s_versions, name, settings, refused):
    sets = [arg for setting in settings for arg in ("--set", setting)]
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *sets]
    if VALUES[name] is not None:
        args += ["--values", str(VALUES[name])]
    proc = tools.helm_run(*args, check=False)
    assert proc.returncode != 0, f"rendered plaintext beyond the cluster with {settings}"
    assert f"refusing plaintext beyond the cluster: {refused}" in proc.stderr, proc.stderr
    assert "tls.allowPlaintextBeyondCluster=true" in proc.stderr  # the message names the way out
    # With the opt-in it renders, valid, and the components run the plaintext that was asked for.
    docs = render(name, *sets, "--set", "tls.allowPlaintextBeyondCluster=true")
    assert not validate_strictly(docs, k8s_versions)
    for workload in workloads(docs):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = container_env(docs, workload, container, first_pod_name(workload))
        assert [v for k, v in env.items() if k.endswith("_INSECURE")] == ["true"], workload["metadata"]["name"]


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
