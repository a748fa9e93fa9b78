"""The chart's NetworkPolicies, evaluated as a CNI would over every pair of endpoints (they admit
exactly the intended paths), and the metrics ports, ServiceMonitor and PrometheusRule wiring.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json

import pytest

from tests.k8s.conftest import (
    CHART,
    NAMESPACE,
    RELEASE,
    ROOT,
    load_values,
    validate_strictly,
)
from tests.k8s.manifests import (
    container_env,
    find,
    first_pod_name,
    selects,
    workloads,
)

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
