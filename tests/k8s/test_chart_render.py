"""The Helm chart and the kustomize tree, rendered and validated offline with real helm and kubectl.

Lint and render every values file; validate every manifest strictly against the Kubernetes
schemas (1.30 and the newest kubernetes-validate ships); build every kustomize overlay and check it
equals the chart's render; the values schema refuses bad values and stays in step with the
services' flags.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from tests.k8s.conftest import (
    CHART,
    K8S,
    NAMESPACE,
    OVERLAYS,
    ROOT,
    VALUES,
    load_docs,
    validate_strictly,
)
from tests.k8s.manifests import (
    ALL_VALUES,
    container_env,
    find,
    first_pod_name,
    learner_sets,
    one,
)

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
    # Fragment shards' flags are set only with several shards (shard 0's Deployment is checked).
    shard_docs = render("hub", "--set", "tls.enabled=false", "--set", "tls.allowPlaintextBeyondCluster=true",
                        "--set", "syncer.shards=2")
    # Client TLS towards etcd's flags are set only with its Secret (and a server name).
    etcd_docs = render("hub", "--set", "syncer.settings.coordEtcd=https://etcd-0.etcd:2379", "--set",
                       "syncer.etcdTLS.existingSecret=etcd-client", "--set", "syncer.etcdTLS.serverName=etcd")
    for component, cls in render_k8s.service_configs().items():
        wired, unsupported = set(render_k8s.WIRED[component]), render_k8s.UNSUPPORTED[component]
        wired_tls, wired_shards = render_k8s.WIRED_TLS[component], render_k8s.WIRED_SHARDS[component]
        wired_etcd = render_k8s.WIRED_ETCD_TLS[component]
        assert not (wired | wired_tls | wired_shards | wired_etcd) & unsupported
        fields = {f.name for f in dataclasses.fields(cls)}
        settings = set(schema["properties"][component]["properties"]["settings"]["properties"])
        expected = {render_k8s.camel(f) for f in fields - wired - wired_tls - wired_shards - wired_etcd - unsupported}
        assert settings == expected, f"{component}.settings drifted from {cls.__name__}: run `make k8s-render`"
        assert wired_tls <= fields, f"{component}: WIRED_TLS names flags {cls.__name__} does not have"
        for rendered, names in ((docs, wired), (tls_docs, wired_tls), (shard_docs, wired_shards),
                                (etcd_docs, wired_etcd)):
            workload = (learner_sets(rendered)[0] if component == "learners" else
                        find(rendered, "Deployment", "ddiloco-syncer")[0] if component == "syncer" else
                        one(rendered, "StatefulSet" if component == "store" else "Deployment", component))
            (container,) = workload["spec"]["template"]["spec"]["containers"]
            env = container_env(rendered, workload, container, first_pod_name(workload))
            for name in names & fields:
                assert prefixes[component] + name.upper() in env, f"{component}: the chart does not set {name}"
