"""The system end to end: checkpoint store, syncer, learners and evaluator as real processes.

1. Four learners train; the held-out loss of the global model falls.
2. SIGKILL a learner: merges go on (quorum); restarted, it rejoins with a new incarnation.
3. SIGKILL the syncer: learners keep training; the restarted syncer restores the last committed
   checkpoint bit-exactly; learners reconnect and merges resume from the restored versions.
4. Kill the checkpoint store: training goes on; checkpoints resume when it is back; every
   committed checkpoint stays readable.
(Scenario 5, bad uploads, is in test_upload_validation.py.)
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from services.syncer import checkpointing
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, store_call, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _final_heldout_loss(cluster, num_shards: int) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "services.learner.evaluator", "--once", "--syncer", cluster.services["syncer"].address,
         "--num-shards", str(num_shards), "--log-level", "WARNING", "--timeout-s", "60"],
        capture_output=True, text=True, timeout=120, env=cluster.env, check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["heldout_loss"]


def _contributors_since(state, since_unix_s: float) -> set[tuple[str, int]]:
    return {
        (c.learner_id, c.incarnation)
        for r in state.recent_merges if r.merged_at_unix_s >= since_unix_s
        for c in r.contributors
    }


def test_four_learners_train_and_global_heldout_loss_falls(cluster):
    cluster.start_store()
    syncer = cluster.start_syncer(run_id="e2e-train", extra=TINY)
    cluster.start_evaluator(extra=["--interval-s", "3", "--num-shards", "4"])
    for i in range(4):
        cluster.start_learner(i, region=f"region-{i % 2}", extra=["--steps", "120", "--num-shards", "4", *LEARNER_PACE])
    probe = SyncerProbe(syncer.address)
    try:
        for svc in cluster.learners():
            assert svc.wait(300) == 0, svc.log_tail()
        final_loss = _final_heldout_loss(cluster, num_shards=4)
        state = probe.state()
    finally:
        probe.close()
    first_loss = state.evals[0].heldout_loss
    # ln(256) = 5.55 nats/byte at initialization; the tiny model learns byte statistics fast.
    assert first_loss > 5.0
    assert final_loss < first_loss - 1.0, (first_loss, final_loss)
    assert {m.learner_id for m in state.members} == {f"learner-{i}" for i in range(4)}
    assert all(m.uploads_accepted > 0 for m in state.members), state.members
    assert state.outer_steps >= 40
    assert state.tokens_merged > 0 and state.bytes_in > 0 and state.bytes_out > 0
    regions = {m.region for m in state.members}
    assert regions == {"region-0", "region-1"}
    seeded = []
    for i in range(4):
        summary = json.loads((cluster.workdir / f"learner-{i}.summary.json").read_text())
        assert summary["steps"] == 120 and summary["fragments_applied"] > 0
        assert summary["client"]["fragments_received"] > 0, summary["client"]
        seeded.append(summary["client"]["fragments_seeded"])
    # The first learner to join found every fragment at version 0 and computed it itself
    # (hash-checked) instead of downloading it; later joiners hold what is still at version 0.
    assert max(seeded) == len(state.fragments), seeded


def test_learner_sigkill_quorum_continues_and_restart_rejoins(cluster):
    syncer = cluster.start_syncer(run_id="e2e-learner-kill", extra=[*TINY, "--min-quorum", "2", "--liveness-timeout-s", "3"])
    for i in range(3):
        cluster.start_learner(i, region="r", extra=["--num-shards", "3", *LEARNER_PACE])
    probe = SyncerProbe(syncer.address)
    try:
        wait_until(lambda: len(probe.state(0).members) == 3 and all(m.uploads_accepted > 0 for m in probe.state(0).members)
                   and probe.state(0).outer_steps >= 8, timeout_s=180, what="three learners contributing")
        victim = cluster.services["learner-0"]
        old_incarnation = probe.member("learner-0").incarnation
        victim.signal(signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL
        killed_at = time.time()
        steps_at_kill = probe.state(0).outer_steps
        # Quorum K=2 is still met by the two survivors: merges go on without the dead learner.
        wait_until(lambda: probe.state(0).outer_steps >= steps_at_kill + 12, timeout_s=90, what="merges without learner-0")
        from ddiloco.v1 import syncer_pb2

        wait_until(lambda: probe.member("learner-0").status == syncer_pb2.MemberState.STATUS_SILENT, timeout_s=30,
                   what="learner-0 marked silent")
        # Rounds may hold for the dead learner within the grace window until it is marked silent:
        # wait for a merge after the kill rather than expecting one already.
        wait_until(lambda: _contributors_since(probe.state(), killed_at + 1.0), timeout_s=30,
                   what="a merge after the kill")
        late = _contributors_since(probe.state(), killed_at + 1.0)
        assert late and all(lid != "learner-0" for lid, _ in late), late
        # Restart: a new life (new incarnation) joins, fetches the global model and contributes.
        victim.start()
        wait_until(lambda: probe.member("learner-0").incarnation != old_incarnation, timeout_s=120, what="rejoin")
        new_incarnation = probe.member("learner-0").incarnation
        assert new_incarnation > old_incarnation
        wait_until(lambda: ("learner-0", new_incarnation) in _contributors_since(probe.state(), killed_at),
                   timeout_s=120, what="a merge containing the restarted learner")
        assert probe.member("learner-0").joins == 2
    finally:
        probe.close()


def test_syncer_sigkill_restores_checkpoint_bit_exactly_and_learners_reconnect(cluster):
    store = cluster.start_store()
    syncer = cluster.start_syncer(run_id="e2e-syncer-kill", extra=[*TINY, "--checkpoint-every-merges", "4"])
    for i in range(2):
        cluster.start_learner(i, region="r", extra=["--num-shards", "2", *LEARNER_PACE])
    probe = SyncerProbe(syncer.address)
    try:
        wait_until(lambda: probe.state(0).last_checkpoint_outer_step >= 8, timeout_s=180, what="a checkpoint")
        steps_before = {m.learner_id: m.local_step for m in probe.state(0).members}
        syncer.signal(signal.SIGKILL)
        assert syncer.wait(10) == -signal.SIGKILL
        time.sleep(3.0)
        assert all(s.alive() for s in cluster.learners()), "learners must survive a syncer crash"

        # What the store holds: the latest committed checkpoint, hashed independently here.
        async def latest(client):
            manifest = await client.latest_manifest("e2e-syncer-kill")
            return manifest, {ref.name: await client.get_blob(ref.digest) for ref in manifest.blobs}

        manifest, blobs = store_call(store.address, latest)
        snapshot = checkpointing.load_snapshot(blobs)
        expected = {
            str(f.fragment_id): {
                "version": f.version,
                "sha256": hashlib.sha256(np.asarray(f.params, dtype="<f4").tobytes()).hexdigest(),
            }
            for f in snapshot.fragments
        }
        syncer.start()
        syncer.wait_ready(120)
        ready = json.loads(syncer.ready_file.read_text())
        assert ready["restored"] is True
        assert ready["outer_steps"] == manifest.step == snapshot.outer_steps
        assert ready["fragments"] == expected  # bit-exact: same bytes, same versions

        # Learners reconnect to the new syncer life and merges resume from the restored versions.
        wait_until(lambda: all(m.uploads_accepted > 0 for m in probe.state(0).members)
                   and probe.state(0).outer_steps >= manifest.step + 8, timeout_s=120, what="merges after restore")
        state = probe.state()
        assert state.restored_from_checkpoint and state.syncer_instance == ready["instance"]
        first_version = {}
        for r in state.recent_merges:
            first_version.setdefault(str(r.fragment_id), r.version)
        for fid, version in first_version.items():
            assert version == expected[fid]["version"] + 1, (fid, version, expected[fid])
        steps_after = {m.learner_id: m.local_step for m in state.members}
        for lid, before in steps_before.items():
            assert steps_after[lid] > before + 20, (lid, before, steps_after[lid])
    finally:
        probe.close()


def test_checkpoint_store_outage_does_not_stop_training(cluster):
    store = cluster.start_store()
    syncer = cluster.start_syncer(
        run_id="e2e-store-down", extra=[*TINY, "--checkpoint-every-merges", "2", "--checkpoint-timeout-s", "3"]
    )
    for i in range(2):
        cluster.start_learner(i, region="r", extra=["--num-shards", "2", *LEARNER_PACE])
    probe = SyncerProbe(syncer.address)
    try:
        wait_until(lambda: probe.state(0).last_checkpoint_outer_step > 0, timeout_s=180, what="a first checkpoint")
        store.signal(signal.SIGKILL)
        assert store.wait(10) == -signal.SIGKILL
        time.sleep(1.0)  # a checkpoint already in flight may still have committed
        ckpt_during = probe.state(0).last_checkpoint_outer_step
        merges_at_outage = probe.state(0).outer_steps
        wait_until(lambda: probe.state(0).outer_steps >= merges_at_outage + 16, timeout_s=120,
                   what="merges while the store is down")
        assert probe.state(0).last_checkpoint_outer_step == ckpt_during
        assert syncer.alive()
        store.start()
        store.wait_ready(60)
        wait_until(lambda: probe.state(0).last_checkpoint_outer_step > ckpt_during, timeout_s=120,
                   what="checkpoints after the store is back")

        async def load_all(client):
            loaded = []
            for manifest in await client.list_manifests("e2e-store-down"):
                blobs = {ref.name: await client.get_blob(ref.digest) for ref in manifest.blobs}
                loaded.append((manifest.step, checkpointing.load_snapshot(blobs)))
            return loaded

        loaded = store_call(store.address, load_all)
        assert loaded, "no committed checkpoint"
        for step, snapshot in loaded:
            assert snapshot.outer_steps == step
            for frag in snapshot.fragments:
                digest = hashlib.sha256(np.asarray(frag.params, dtype="<f4").tobytes()).hexdigest()
                assert digest == frag.params_sha256
                assert np.all(np.isfinite(frag.params))
    finally:
        probe.close()
