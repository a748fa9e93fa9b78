"""A learner SIGKILLed after a snapshot and restarted with the same id resumes (real processes).

learner-0 trains with --state-dir (the shipped snapshot interval: every 100 steps) next to
learner-1, which keeps merging while learner-0 is down. learner-0 is killed with SIGKILL some
steps after its snapshot, then restarted with --steps 40 beyond the snapshot's step: it resumes at
that step (its log says so, with a sha256 of the optimizer state it restored, which equals the
snapshot file's leaves'), and at exit its data position is the snapshot's advanced by exactly 40
batches (it continued the sequence: no new one, no replay of batches before the snapshot) and its
optimizer's step counts went on from the snapshot's. Last, the snapshot relabelled as another run's
is refused with a warning and the learner starts from the global model.

Throughout, no step of learner-0's work reaches the global model twice: on every fragment, the
merged contributions of the later lives never cover a step up to the snapshot that the killed life
also had merged (the work between the snapshot and the kill is redone, and may be merged twice,
as documented).
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal

import numpy as np
import pytest

from ddiloco import build_info
from ddiloco.data import corpus
from ddiloco.learner import snapshot as snapshot_lib
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

MORE_STEPS = 40


class _Merges:
    """Every merge record seen, polled (the syncer keeps the last 256)."""

    def __init__(self, probe: SyncerProbe) -> None:
        self.probe = probe
        self.records: dict[tuple[int, int], object] = {}

    def poll(self):
        state = self.probe.state()
        for record in state.recent_merges:
            self.records[(record.fragment_id, record.version)] = record
        return state

    def intervals(self, learner_id: str) -> list[tuple[int, int, int, int]]:
        """(fragment, incarnation, first step, last step) of each merged contribution of the learner."""
        return [(r.fragment_id, c.incarnation, c.local_step - c.steps + 1, c.local_step)
                for r in self.records.values() for c in r.contributors if c.learner_id == learner_id and c.steps]


def _restart(cluster, state_dir, steps: int, merges: _Merges):
    svc = cluster.start_learner(0, region="region-a", extra=[
        "--steps", str(steps), "--num-shards", "2", "--state-dir", str(state_dir), *LEARNER_PACE])
    for _ in range(240):  # polling the merges meanwhile: learner-1 merges faster than the history keeps them
        if svc.wait(1.0) is not None:
            break
        merges.poll()
    assert svc.wait(1.0) == 0, svc.log_tail()
    merges.poll()
    return svc, json.loads((cluster.workdir / "learner-0.summary.json").read_text())


def test_a_killed_learner_resumes_its_optimizer_state_and_data_position_without_merging_work_twice(cluster):
    syncer = cluster.start_syncer(run_id="resume", extra=TINY)
    state_dir = cluster.workdir / "state" / "learner-0"
    store = snapshot_lib.SnapshotStore(state_dir)
    cluster.start_learner(1, region="region-b", extra=["--steps", "0", "--num-shards", "2", *LEARNER_PACE])
    first = cluster.start_learner(0, region="region-a", extra=[
        "--steps", "0", "--num-shards", "2", "--state-dir", str(state_dir), *LEARNER_PACE])
    probe = SyncerProbe(syncer.address)
    merges = _Merges(probe)
    try:
        wait_until(lambda: store.path.exists(), timeout_s=240, what="learner-0's first snapshot")
        snap = store.load()
        # Well past the snapshot: every fragment was contributed again by the life about to die.
        wait_until(lambda: merges.poll() and (probe.member("learner-0").local_step >= snap.step + 16),
                   timeout_s=120, what="steps after the snapshot")
        first.signal(signal.SIGKILL)
        assert first.wait(10) is not None
        snap = store.load()  # the latest (a second one may have been written meanwhile)
        killed = probe.member("learner-0")
        assert killed.local_step > snap.step and store.sent_since(snap.step), "work after the snapshot"
        merges.poll()

        # Resume and train on: it continues at the snapshot's step with the snapshot's optimizer state.
        svc, summary = _restart(cluster, state_dir, steps=snap.step + MORE_STEPS, merges=merges)
        resumed = re.search(r"resumed from snapshot .*?step=(\d+) .*?opt_state_sha256=([0-9a-f]{64})",
                            svc.log_path.read_text())
        assert resumed, svc.log_tail()
        # The start line names the build (version from the package metadata, the commit).
        assert re.search(rf"learner learner-0 training .*version={re.escape(build_info.version())} "
                         rf"commit={build_info.commit()}", svc.log_path.read_text()), svc.log_tail()
        assert re.search(rf"syncer serving on .*version={re.escape(build_info.version())} "
                         rf"commit={build_info.commit()}", syncer.log_path.read_text()), syncer.log_tail()
        assert int(resumed.group(1)) == snap.step == summary["resumed_from_step"]
        assert resumed.group(2) == snapshot_lib.leaves_sha256(snap.opt_leaves)  # the restored leaves, hashed
        assert summary["steps"] == snap.step + MORE_STEPS and summary["finish"]["all_merged"], summary["finish"]
        # Where the restart's time went, up to its first inner step (this life's, after the resume).
        startup = summary["startup"]
        phases = ("process_and_imports", "devices_and_health", "join", "data", "build_and_resume", "first_step")
        assert list(startup) == ["total_s", *phases] and all(startup[p] >= 0 for p in phases), startup
        assert startup["process_and_imports"] > 0.1  # an interpreter that imported JAX
        assert startup["total_s"] == pytest.approx(sum(startup[p] for p in phases), abs=0.01)
        assert svc.log_path.read_text().count("first inner step") == 2, svc.log_tail()  # one per life
        # The data sequence continued from the snapshot's position: exactly MORE_STEPS batches later.
        final = store.load()
        position = snap.sampler
        replay = corpus.BatchSampler(np.zeros(position["tokens"], np.uint16), position["batch_size"],
                                     position["window"] - 1, seed=0)
        replay.seek(position)
        for _ in range(MORE_STEPS):
            replay.next()
        assert final.sampler == replay.position() != position
        # And the optimizer's step counts (the LR schedule's) went on from the snapshot's.
        counts = {k: int(v) for k, v in final.opt_leaves.items() if k.endswith(".count")}
        assert counts and set(counts.values()) == {snap.step + MORE_STEPS}, counts
        assert {int(v) for k, v in snap.opt_leaves.items() if k.endswith(".count")} == {snap.step}
        merges.poll()
        _assert_no_step_merged_twice(merges, killed.incarnation, snap.step)

        # A snapshot of another run (here: the same file, relabelled) is refused with a warning; the
        # learner starts from the global model at step 0.
        store.write(dataclasses.replace(final, identity=dataclasses.replace(final.identity, run_id="another-run")))
        svc, summary = _restart(cluster, state_dir, steps=5, merges=merges)
        assert "not resuming: the snapshot" in svc.log_path.read_text() and "another run id" in svc.log_path.read_text()
        assert summary["resumed_from_step"] == 0 and summary["steps"] == 5
        assert store.load().identity.run_id == "resume"  # replaced by this run's snapshot at exit
    finally:
        probe.close()


def _assert_no_step_merged_twice(merges: _Merges, killed_incarnation: int, snapshot_step: int) -> None:
    """Later lives' merged steps up to the snapshot never overlap the killed life's."""
    by_life = merges.intervals("learner-0")
    killed_life = [i for i in by_life if i[1] == killed_incarnation]
    later = [i for i in by_life if i[1] != killed_incarnation]
    assert killed_life and later
    for fid, _, lo, hi in later:
        for kfid, _, klo, khi in killed_life:
            if kfid == fid:
                assert min(hi, khi, snapshot_step) < max(lo, klo), (
                    f"fragment {fid}: steps {lo}-{hi} of a resumed life and {klo}-{khi} of the killed life "
                    f"overlap at or before the snapshot step {snapshot_step}: merged twice")
