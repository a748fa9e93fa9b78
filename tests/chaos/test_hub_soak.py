"""Issue 23's soak, short: the hub region under fire (`hub-soak-short`, ddiloco/chaos/hub.py).

Two syncers elected on a local 3-member etcd, two replicated stores, 3 learners; a seeded kill
loop over 45 s across both syncers (kill, term, stop), both stores (kill, disk wipe), one etcd
member at a time and the learners' processes and links. Every invariant must hold: no lost
acknowledged upload, nothing applied twice (I1, over every syncer life of both syncers), versions
consistent (I2), learners converge to the final leader's hashes (I3), every checkpoint loads from
each store after one repair pass (I4), and no learner folds in an older leader epoch after a newer
one (I6). I5 (the loss) needs the fault-free twin and is left to the full soak
(`ddiloco chaos run --scenario hub-soak --seed N`, which runs it first); replay a run with
`ddiloco chaos replay <out>/hub-soak-short-seed1/faults.jsonl`.
"""

from __future__ import annotations

import json

import pytest

from ddiloco.chaos import harness
from tests.chaos.conftest import build

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.timeout(420)]


def test_hub_soak_short_keeps_every_invariant_across_syncers_stores_and_etcd(tmp_path, jax_cache,
                                                                             learner_compilation_cache, capsys):
    # The session's learner compilation cache (the other chaos runs' programs), not one per run.
    scenario, events = build("hub-soak-short", learner_compilation_cache)
    result = harness.run_scenario(scenario, events, tmp_path / "hub", jax_cache_dir=jax_cache)
    with capsys.disabled():
        print(f"\n{result.report_line}")
    assert result.ok, "\n".join([result.report_line, *result.violations()])
    i1 = result.check("I1").figures
    assert i1["lost"] == 0 and i1["double_applied"] == 0 and i1["acked"] > 0, i1
    targets = {f.target.split("-")[0] for f in result.faults}
    assert {"syncer", "store", "etcd", "learner"} <= targets, targets
    assert len(result.faults) >= 8, result.report_line
    for check in (c for c in result.checks if c.name.startswith("I4")):  # each store, after repair
        assert check.figures["checkpoints"] > 0 and check.figures["loadable"] == check.figures["checkpoints"], check
    assert result.check("I3").figures["hash_equal"] == scenario.learners, result.report_line
    assert result.check("I6").figures["epochs"] >= 2, result.check("I6")  # a failover happened
    # Every manifest on either store carries the epoch of the leader that wrote it (the stores keep
    # one lineage per run: services/checkpoint/store.py).
    for store in ("store-a", "store-b"):
        manifests = sorted((tmp_path / "hub" / "cluster" / store / "manifests" / "chaos-hub-soak-short").glob("*.json"))
        epochs = [int(json.loads(m.read_text())["metadata"].get("leader_epoch", "0")) for m in manifests]
        assert manifests and min(epochs) > 0 and epochs == sorted(epochs), (store, epochs)
