"""Mutual TLS in the chart: certificates, server names and health probes wired; every pod mounts
only the CA and its own key pair; the example values use mTLS on every connection; plaintext gRPC
leaves the cluster only with the explicit opt-in.
"""

from __future__ import annotations

import pytest

from tests.k8s.conftest import (
    CHART,
    NAMESPACE,
    OVERLAYS,
    RELEASE,
    VALUES,
    load_values,
    validate_strictly,
)
from tests.k8s.manifests import (
    container_env,
    find,
    first_pod_name,
    one,
    pod_specs,
    workloads,
)

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
