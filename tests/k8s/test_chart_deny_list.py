"""The certificate deny list in the chart (tls.denyList, tls.denyListConfigMap): the syncer and the
store are told the file and have it mounted as a directory (so the kubelet's updates reach the
running servers, which re-read it without a restart), with exactly the listed entries; no other
pod sees it; without TLS nothing is rendered."""

from __future__ import annotations

from tests.k8s.manifests import container_env, first_pod_name, workloads

TLS = ("--set", "tls.enabled=true", "--set", "tls.existingSecret=ddiloco-tls")


def _servers(docs) -> dict[str, tuple[dict, dict]]:
    out = {}
    for w in workloads(docs):
        pod = w["spec"]["template"]
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        (container,) = pod["spec"]["containers"]
        out.setdefault(component, (w, container, pod))
    return out


def test_deny_list_is_mounted_into_the_syncer_and_the_store_only(render):
    docs = render("default", *TLS, "--set", "tls.denyList={learner/learner-7,0x3F9A0001}")
    (config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("tls-deny-list")]
    entries = [line for line in config["data"]["deny.txt"].splitlines() if line and not line.startswith("#")]
    assert entries == ["learner/learner-7", "0x3F9A0001"]
    env_names = {"syncer": "DDILOCO_SYNCER_TLS_DENY_LIST", "store": "DDILOCO_CHECKPOINT_TLS_DENY_LIST"}
    for component, (workload, container, pod) in _servers(docs).items():
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        env = container_env(docs, workload, container, first_pod_name(workload))
        if component in env_names:
            mount = mounts["tls-deny-list"]
            assert "subPath" not in mount and mount["readOnly"], mount  # updates must reach the pod
            assert volumes["tls-deny-list"]["configMap"]["name"] == config["metadata"]["name"]
            assert env[env_names[component]] == f"{mount['mountPath']}/deny.txt"
            # No hash of the list on the pod: a revocation must not restart the servers.
            assert config["metadata"]["name"] not in str(pod["metadata"].get("annotations", {}))
        else:
            assert "tls-deny-list" not in mounts and not any(k.endswith("TLS_DENY_LIST") for k in env), component


def test_an_existing_config_map_replaces_the_charts_and_plaintext_renders_none(render):
    docs = render("default", *TLS, "--set", "tls.denyListConfigMap=ops-deny")
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("tls-deny-list")]
    syncer_pod = _servers(docs)["syncer"][2]
    assert {v["name"]: v for v in syncer_pod["spec"]["volumes"]}["tls-deny-list"]["configMap"]["name"] == "ops-deny"
    plain = render("default")
    assert not [d for d in plain if d["kind"] == "ConfigMap" and "deny" in d["metadata"]["name"]]
    assert "TLS_DENY_LIST" not in str(plain)
