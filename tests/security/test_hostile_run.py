"""Fault-matrix row 21 end to end: one of four learners is hostile (`python -m
ddiloco.chaos.hostile_learner --hostile ...`, the learner with a client that multiplies every
pseudo-gradient it uploads), against an honest run of four learners.

The hard guarantees, asserted: for huge updates (`scale:1e4`) not one upload of the hostile
learner is accepted; it is refused by the norm bound and quarantined after three refusals. For
sign-flipped updates (`signflip`), which have honest norms and pass every norm bound, the
direction check refuses them from the first upload (the first contributions to a fragment wait for
each other, up to 8 s, instead of being merged before there is anything to compare them with; one
upload may still slip through if the others start more than that later) and quarantines the
learner; no honest learner is refused by it in any run (ddiloco.algo.robust.DirectionPolicy has the measured cosine
distributions). Everything is visible in the training state.

The stated margin, for both: the final held-out loss of the global model stays within 35 % of the
same three honest learners training on their own. At 100 tiny-model steps on a loaded 2-core
machine, merge timing makes runs noisy: measured gaps were +4.3 % and +16.8 % (x1e4), and two
honest runs (three vs four learners) differed by 2-4 %; the margin covers that noise and still
separates the defended runs from undefended ones (x1e4 with `--norm-bound-factor 0` ends at a
held-out loss of ~6e12). The quarantined learner's quarter of the compute is lost by design, so
against four honest learners the gap is larger (measured +0.3 % to +22 %); that gap is reported,
not bounded. Real processes on 127.0.0.1 (the same LocalCluster as `ddiloco up`), the tiny model,
100 inner steps per learner, the same data order in every run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ddiloco.cli import cluster as cluster_lib
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MARGIN = 0.35
STEPS = 100


def _run(workdir, hostile: str | None, learners: int = 4) -> dict:
    cluster = cluster_lib.LocalCluster(workdir)
    try:
        syncer = cluster.start_syncer(run_id="hostile" if hostile else "honest", extra=TINY)
        for i in range(learners):
            # A fixed incarnation fixes each learner's data order: both runs see the same batches.
            extra = ["--steps", str(STEPS), "--num-shards", "4", "--seed", "1", "--incarnation", "1", *LEARNER_PACE]
            if hostile and i == 3:
                cluster.start_learner(i, region=f"region-{i % 2}", extra=["--hostile", hostile, *extra],
                                      module="ddiloco.chaos.hostile_learner")
            else:
                cluster.start_learner(i, region=f"region-{i % 2}", extra=extra)
        started = time.monotonic()
        for svc in cluster.learners():
            assert svc.wait(600) == 0, svc.log_tail()
        wall_s = time.monotonic() - started
        out = subprocess.run(
            [sys.executable, "-m", "services.learner.evaluator", "--once", "--syncer", syncer.address,
             "--num-shards", "4", "--log-level", "WARNING", "--timeout-s", "60"],
            capture_output=True, text=True, timeout=180, env=cluster.env, check=True,
        ).stdout
        probe = SyncerProbe(syncer.address)
        try:
            state = probe.state(0)
        finally:
            probe.close()
        return {"loss": json.loads(out.strip().splitlines()[-1])["heldout_loss"], "state": state, "wall_s": wall_s}
    finally:
        cluster.stop_all(timeout_s=10.0)


def _members_line(state) -> str:
    """Merges, and each learner's accepted uploads and refusals: what a loss outside the margin is
    read from (a learner none of whose uploads got in trains nothing into the model)."""
    members = ", ".join(
        f"{m.learner_id} {m.uploads_accepted} accepted"
        + (" (refused: " + ", ".join(f"{k} {v}" for k, v in sorted(m.rejections.items()) if v) + ")"
           if any(m.rejections.values()) else "")
        for m in sorted(state.members, key=lambda m: m.learner_id))
    return f"{state.outer_steps} merges; {members}"


def test_hostile_learners_against_an_honest_run(tmp_path, capsys):
    honest = _run(tmp_path / "honest", None)
    # The defence refuses every upload of the hostile learner, so what it is answerable for is the
    # gap to the same three honest learners on their own (the fourth learner's compute is lost
    # to quarantine by design; the gap to four honest learners is reported too).
    honest3 = _run(tmp_path / "honest3", None, learners=3)
    huge = _run(tmp_path / "huge", "scale:1e4")
    flip = _run(tmp_path / "signflip", "signflip")
    state = huge["state"]
    members = {m.learner_id: m for m in state.members}
    bad = members["learner-3"]
    flip_members = {m.learner_id: m for m in flip["state"].members}
    report = (
        f"held-out loss: honest {honest['loss']:.4f}; the three honest learners alone {honest3['loss']:.4f}; "
        f"with a x1e4 learner {huge['loss']:.4f} ({huge['loss'] / honest3['loss'] - 1:+.1%} vs the three, "
        f"{huge['loss'] / honest['loss'] - 1:+.1%} vs four honest); with a sign-flipping learner {flip['loss']:.4f} "
        f"({flip['loss'] / honest3['loss'] - 1:+.1%} vs the three, {flip['loss'] / honest['loss'] - 1:+.1%} vs four)\n"
        f"x1e4 run: norm-bound refusals {state.uploads['rejected_norm_bound']}, quarantined refusals "
        f"{state.uploads['rejected_quarantined']}; marginal refusals honest/x1e4/signflip "
        f"{honest['state'].uploads['rejected_norm_bound_marginal']}/{state.uploads['rejected_norm_bound_marginal']}/"
        f"{flip['state'].uploads['rejected_norm_bound_marginal']}\n"
        f"signflip run: direction refusals {flip['state'].uploads['rejected_direction']}, quarantined refusals "
        f"{flip['state'].uploads['rejected_quarantined']}, learner-3 uploads accepted "
        f"{flip_members['learner-3'].uploads_accepted}; first contributions that waited for references "
        f"{flip['state'].direction_judgments['waited']}, went on unjudged {flip['state'].direction_judgments['unjudged']}"
        f"; direction agreement " + ", ".join(
            f"{lid} {m.direction_agreement:+.2f}" for lid, m in sorted(flip_members.items()))
        + f"\nwall s: {honest['wall_s']:.0f} / {honest3['wall_s']:.0f} / {huge['wall_s']:.0f} / {flip['wall_s']:.0f}"
        + "".join(f"\n{name} run: {_members_line(run['state'])}"
                  for name, run in (("honest", honest), ("honest3", honest3), ("x1e4", huge), ("signflip", flip)))
    )
    with capsys.disabled():
        print("\n" + report)
    # Huge updates: every one refused, the learner quarantined after three, the loss within the margin.
    assert bad.quarantined and bad.rejections["norm_bound"] >= 3, (report, bad)
    assert state.quarantines == 1 and all(not m.quarantined for lid, m in members.items() if lid != "learner-3")
    assert all(m.rejections["norm_bound"] == 0 for lid, m in members.items() if lid != "learner-3"), report
    assert bad.uploads_accepted == 0, report
    assert huge["loss"] <= honest3["loss"] * (1 + MARGIN), report
    # The honest runs: no learner refused as hostile, none quarantined (marginal refusals, less than
    # twice the bound, can happen while learners' warmups are out of step; they are reported).
    for run in (honest, honest3):
        assert run["state"].uploads["rejected_norm_bound"] == 0 and run["state"].quarantines == 0, report
        assert run["state"].uploads["rejected_direction"] == 0, report
    # Sign flips pass every norm check; the direction check refuses them and quarantines the
    # learner, and refuses no honest learner.
    flipper = flip_members["learner-3"]
    assert flipper.quarantined and flipper.rejections["direction"] >= 3, (report, flipper)
    assert flip["state"].quarantines == 1 and flip["state"].uploads["rejected_norm_bound"] == 0, report
    assert all(m.rejections["direction"] == 0 and not m.quarantined
               for lid, m in flip_members.items() if lid != "learner-3"), report
    # The first contributions of a run wait for each other (DirectionPolicy.judge_wait_s) instead of
    # being merged unjudged: the flipper's uploads are refused from the first, and the model stays
    # within the margin of the three honest learners alone.
    # (How many first contributions waited depends on when the learners joined: one that uploads
    # before two others have joined has nobody to wait for. The counts are in the report.)
    assert flipper.uploads_accepted <= 1, report
    assert flip["loss"] <= honest3["loss"] * (1 + MARGIN), report
