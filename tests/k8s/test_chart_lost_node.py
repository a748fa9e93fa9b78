"""The lost-node runbook in docs/deploy.md ("A lost node: stuck store and learner pods") names pods,
volume claims and a namespace: they must be what the chart renders for the shipped values, or an
operator following it at 3 a.m. deletes nothing (or the wrong thing). Also checked: the store and
the learners, the StatefulSet pods the runbook is for, tolerate a lost node for the seconds it says."""

from __future__ import annotations

import re

from tests.k8s.conftest import NAMESPACE, RELEASE, ROOT, load_values
from tests.k8s.manifests import find, pod_specs

RUNBOOK_TITLE = "**A lost node: stuck store and learner pods.**"


def _runbook() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index(RUNBOOK_TITLE)
    return text[start:text.index("\n### ", start)]


def _pvc_names(statefulset: dict) -> set[str]:
    """The claims of the StatefulSet's pods: <template>-<statefulset>-<ordinal>."""
    replicas = int(statefulset["spec"].get("replicas", 1))
    return {f"{t['metadata']['name']}-{statefulset['metadata']['name']}-{i}"
            for t in statefulset["spec"].get("volumeClaimTemplates", []) for i in range(replicas)}


def test_the_runbook_names_the_store_and_learner_pods_and_claims_the_chart_renders(render):
    runbook = _runbook()
    named = set(re.findall(r"`([a-z0-9-]+)`", runbook))
    commands = re.findall(r"`(kubectl [^`]+)`", runbook)
    assert f"release `{RELEASE}` in\nnamespace `{NAMESPACE}`" in runbook
    assert commands and all(f"-n {NAMESPACE} " in c for c in commands if " -n " in c), commands
    hub, region_a = render("hub"), render("region-a")
    [store] = find(hub, "StatefulSet", f"{RELEASE}-store")
    pods = {f"{sts['metadata']['name']}-{i}" for docs in (hub, region_a) for sts in find(docs, "StatefulSet")
            for i in range(int(sts["spec"].get("replicas", 1)))}
    claims = _pvc_names(store)
    mentioned_pods = {n for n in named if n.startswith(f"{RELEASE}-") and re.search(r"-\d+$", n)}
    mentioned_claims = {n for n in named if n.startswith("data-")}
    assert mentioned_pods and mentioned_pods <= pods, (mentioned_pods - pods, sorted(pods))
    assert mentioned_claims and mentioned_claims <= claims, (mentioned_claims, claims)
    for command in commands:  # every pod or claim a command deletes exists
        for target in re.findall(r"delete (?:pod|pvc) ([a-z0-9-]+)", command):
            assert target in pods | claims, command


def test_the_statefulset_pods_tolerate_a_lost_node_for_the_seconds_the_runbook_says(render):
    seconds = load_values("default")["nodeFailureTolerationSeconds"]
    assert f"after `nodeFailureTolerationSeconds` ({seconds['unreachable']} s" in _runbook()
    for docs in (render("hub"), render("region-a")):
        specs = {name: spec for name, _, spec in pod_specs(docs)}
        statefulsets = [s["metadata"]["name"] for s in find(docs, "StatefulSet")]
        assert statefulsets
        for name in statefulsets:
            taints = {t["key"]: t.get("tolerationSeconds") for t in specs[name].get("tolerations", [])
                      if t.get("effect") == "NoExecute"}
            assert taints == {"node.kubernetes.io/not-ready": seconds["notReady"],
                              "node.kubernetes.io/unreachable": seconds["unreachable"]}, (name, taints)
