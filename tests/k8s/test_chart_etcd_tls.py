"""Client TLS towards etcd in the chart (syncer.etcdTLS; docs/deploy.md#etcd-client-tls): with the
Secret given, the syncer pods alone mount etcd's CA and the etcd client certificate, and their
environment parses to a syncer dialling etcd over TLS with them; inconsistent values fail the
render. Before syncer.etcdTLS existed the chart had no way to hand the syncers etcd certificates.
"""

from __future__ import annotations

import json

from tests.k8s.conftest import CHART, load_values, validate_strictly
from tests.k8s.manifests import container_env, first_pod_name, one, pod_specs

ETCD = ("--set", "syncer.replicas=2", "--set",
        "syncer.settings.coordEtcd=https://etcd-0.etcd:2379\\,https://etcd-1.etcd:2379",
        "--set", "syncer.etcdTLS.existingSecret=ddiloco-etcd-client")


def test_only_the_syncer_pods_mount_the_etcd_client_certificate(render, k8s_versions):
    from services.syncer import config as syncer_config

    docs = render("hub", *ETCD)
    problems = validate_strictly(docs, k8s_versions)
    assert not problems, "\n".join(problems)
    mount_path = load_values("hub")["syncer"]["etcdTLS"]["mountPath"]
    deployment = one(docs, "Deployment", "syncer")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = container_env(docs, deployment, container, first_pod_name(deployment))
    cfg = syncer_config.parse_config([], env)
    security = cfg.coord_security()
    assert not security.insecure
    assert (security.tls_ca, security.tls_cert, security.tls_key) == (
        f"{mount_path}/ca.crt", f"{mount_path}/tls.crt", f"{mount_path}/tls.key")
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "ddiloco-etcd-client"]
    assert sorted(item["key"] for item in volume["secret"]["items"]) == ["ca.crt", "tls.crt", "tls.key"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == mount_path and mount["readOnly"]
    # Nothing else (store, learners, evaluator, helm test pods) mounts the etcd Secret or sees its paths.
    for name, _, spec in pod_specs(docs):
        if spec is pod:
            continue
        secrets = {v.get("secret", {}).get("secretName") for v in spec.get("volumes", [])}
        assert "ddiloco-etcd-client" not in secrets, name
    configmaps = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] != "ddiloco-syncer"]
    assert not any("COORD_TLS" in key for cm in configmaps for key in cm.get("data", {})), "etcd TLS outside the syncer"


def test_without_the_secret_the_syncer_mounts_nothing_of_etcd(render):
    docs = render("hub", "--set", "syncer.replicas=2", "--set", "syncer.settings.coordEtcd=etcd-0.etcd:2379")
    deployment = one(docs, "Deployment", "syncer")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = container_env(docs, deployment, container, first_pod_name(deployment))
    assert not any(key.startswith("DDILOCO_SYNCER_COORD_TLS") for key in env)
    assert all(v["name"] != "etcd-tls" for v in deployment["spec"]["template"]["spec"]["volumes"])


def test_inconsistent_etcd_tls_values_fail_the_render(tools, tmp_path):
    cases = [
        ({"syncer": {"settings": {"coordEtcd": "https://etcd-0.etcd:2379"}}}, "set syncer.etcdTLS.existingSecret"),
        ({"syncer": {"etcdTLS": {"existingSecret": "etcd-client"}}}, "it needs syncer.settings.coordEtcd"),
        ({"syncer": {"settings": {"coordEtcd": "etcd-0.etcd:2379"}, "etcdTLS": {"serverName": "etcd"}}},
         "serverName needs syncer.etcdTLS.existingSecret"),
        ({"syncer": {"etcdTLS": {"existingSecrets": "typo"}}}, "existingSecrets"),
        ({"syncer": {"settings": {"coordTlsCa": "/x"}}}, "coordTlsCa"),  # wired by the chart, not a setting
    ]
    for values, complaint in cases:
        bad = tmp_path / "values.yaml"
        bad.write_text(json.dumps(values))
        proc = tools.helm_run("template", "ddiloco", str(CHART), "--values", str(bad), check=False)
        assert proc.returncode != 0 and complaint in proc.stderr, (values, proc.stderr)
