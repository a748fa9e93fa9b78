"""Helpers over the chart's rendered manifests, shared by the tests/k8s/test_chart_*.py modules:
finding documents by kind and component, pod templates, a container's effective environment,
label selectors as Kubernetes evaluates them."""

from __future__ import annotations

import re

from tests.k8s.conftest import VALUES

ALL_VALUES = list(VALUES)
SERVERS = {"syncer": "DDILOCO_SYNCER_BIND", "store": "DDILOCO_CHECKPOINT_BIND"}


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
