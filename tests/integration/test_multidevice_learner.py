"""Learner units of several devices and processes, against a real syncer (CPU virtual devices).

1. A two-process learner unit on this machine (`jax.distributed`, 2 virtual devices per process,
   4 devices in all) trains and syncs: the syncer sees ONE member, only process 0 talks to it, merges
   happen; SIGTERM to process 1 alone stops both at the same step, with bit-identical parameters.
2. A 4-device learner with a 4x global batch beside a 1-device learner: each contribution's merge
   weight is tokens^2/steps from its own fields, tokens per step follow the global batch, and
   per inner step the big unit weighs 16x the small one, under the syncer's default hostile-learner
   bounds: the batch cap allows 4x the others' batch, and in merges of two the share cap applies
   only while the unit's claims cannot be checked yet (the first merges of each fragment) or were
   clipped.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests import ports
from tests.integration.conftest import LEARNER_PACE, TINY, SyncerProbe, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SEQ_LEN = 32  # the tiny preset


def _start_learner(cluster, name: str, *, learner_id: str, devices: int, extra: list[str]):
    """A learner process seeing `devices` virtual CPU devices (its own XLA_FLAGS)."""
    svc = cluster.add(name, "services.learner", [
        "--syncer", cluster.services["syncer"].address, "--learner-id", learner_id, "--region", "r",
        "--summary-file", str(cluster.workdir / f"{name}.summary.json"), "--health-bind", "127.0.0.1:0", *extra,
    ])
    # First: XLA stops reading XLA_FLAGS at a token that is not a flag (the cluster's default ends
    # with one), so a device count appended after it would be ignored.
    flags = f"--xla_force_host_platform_device_count={devices} {cluster.env.get('XLA_FLAGS', '')}".strip()
    svc.env = {**cluster.env, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    svc.start()
    return svc


def _summary(cluster, name: str) -> dict:
    return json.loads((cluster.workdir / f"{name}.summary.json").read_text())


def test_two_process_unit_trains_syncs_and_stays_identical(cluster):
    syncer = cluster.start_syncer(run_id="unit-2proc", extra=TINY)
    port = ports.free_port()
    batch = 8
    procs = [
        _start_learner(cluster, f"learner-unit-p{i}", learner_id="unit-0", devices=2, extra=[
            "--num-processes", "2", "--process-id", str(i), "--coordinator-address", f"127.0.0.1:{port}",
            "--batch-size", str(batch), "--num-shards", "1", *LEARNER_PACE,
        ])
        for i in range(2)
    ]
    probe = SyncerProbe(syncer.address)
    try:
        wait_until(lambda: probe.state(0).outer_steps >= 16, timeout_s=300, what="merges from the unit",
                   interval_s=0.5)
        # SIGTERM to the follower only: the unit agrees to stop at the same step, on both processes.
        procs[1].signal(signal.SIGTERM)
        for svc in procs:
            assert svc.wait(120) == 0, svc.log_tail()
        state = probe.state()
    finally:
        probe.close()
    leader, follower = (_summary(cluster, f"learner-unit-p{i}") for i in range(2))
    # One learner unit: one member, joined once, contributing; merges happened.
    assert [m.learner_id for m in state.members] == ["unit-0"], state.members
    assert state.members[0].joins == 1 and state.members[0].uploads_accepted > 0
    assert state.outer_steps >= 16 and state.recent_merges
    # Only process 0 talked to the syncer.
    assert leader["process_index"] == 0 and follower["process_index"] == 1
    assert leader["client"]["uploads_accepted"] > 0 and leader["client"]["sessions"] >= 1
    assert follower["client"]["sessions"] == 0 and follower["client"]["bytes_sent"] == 0
    assert follower["client"]["uploads_accepted"] == 0
    # Both processes ran the same steps, folded in the same fragments, and end bit-identical.
    for key in ("steps", "tokens", "fragments_applied", "uploads_queued", "incarnation"):
        assert leader[key] == follower[key], key
    assert leader["params_sha256"] == follower["params_sha256"]
    assert leader["fragments_applied"] > 4  # the initial 4 plus merged versions
    assert leader["devices"] == 4 and leader["processes"] == 2 and leader["mesh"] == "4x1"
    # Tokens count the unit's global batch.
    assert leader["steps"] > 0 and leader["tokens"] == leader["steps"] * batch * SEQ_LEN
    for record in state.recent_merges:
        for c in record.contributors:
            assert c.learner_id == "unit-0" and c.tokens == c.steps * batch * SEQ_LEN


# Both units' pace: the 4-device unit starts its first step 2-10 s after the 1-device one (its join
# initializes and hashes on 4 devices, it compiles longer). At LEARNER_PACE (~0.05 s a step) the
# small unit then finished its 48 steps before the big one had taken 3 (CI, twice, and under load
# here), so every merge of the two had one of them share-capped: the late unit's claims unchecked
# in its first merges, then the early unit's steps clipped against the late one's rate (what those
# bounds are for). A step at least 0.2 s keeps such an offset to a fraction of the run: the two step
# side by side for most of it, which is what this test is about.
MIXED_PACE = ["--step-delay-s", "0.2", "--log-every-steps", "50"]
MIXED_STEPS = 96


def test_big_and_small_units_merge_in_proportion_to_tokens(cluster):
    syncer = cluster.start_syncer(run_id="unit-mixed", extra=[*TINY, "--min-quorum", "2"])
    steps = MIXED_STEPS
    big = _start_learner(cluster, "learner-0", learner_id="learner-0", devices=4,
                         extra=["--steps", str(steps), "--batch-size", "16", "--num-shards", "2", *MIXED_PACE])
    small = _start_learner(cluster, "learner-1", learner_id="learner-1", devices=1,
                           extra=["--steps", str(steps), "--batch-size", "4", "--num-shards", "2", *MIXED_PACE])
    probe = SyncerProbe(syncer.address)
    try:
        for svc in (big, small):
            assert svc.wait(420) == 0, svc.log_tail()
        state = probe.state()
    finally:
        probe.close()
    assert _summary(cluster, "learner-0")["devices"] == 4
    assert _summary(cluster, "learner-1")["devices"] == 1
    per_step = {"learner-0": 16 * SEQ_LEN, "learner-1": 4 * SEQ_LEN}
    # Progress reports count the whole global batch per step (the last report may precede the
    # last step: reports are coalesced).
    for m in state.members:
        assert m.local_step > 0 and m.tokens_total == m.local_step * per_step[m.learner_id], m
    for name in per_step:
        assert _summary(cluster, name)["tokens"] == steps * per_step[name]
    both, per_step_ratios, capped = 0, [], 0
    for record in state.recent_merges:
        by_learner = {}
        raw = {c.learner_id: c.tokens**2 / c.steps for c in record.contributors}  # the paper's weight
        for c in record.contributors:
            assert c.tokens == c.steps * per_step[c.learner_id], c
            by_learner[c.learner_id] = c
            others = sum(raw.values()) - raw[c.learner_id]
            if c.weight == pytest.approx(raw[c.learner_id], rel=1e-9):
                continue
            # The shipped share cap (--max-merge-share 0.5): in a merge of two only a contribution whose
            # claims were clipped or not checkable yet, lowered to the other's weight. Either unit can be
            # the unchecked one: whichever contributes a fragment first has no other history to be
            # checked against (the small one when the 4-device unit compiles longer).
            assert len(raw) == 2 and c.weight == pytest.approx(others, rel=1e-9), (c, raw)
            capped += 1
        if len(by_learner) == 2:
            both += 1
            a, b = by_learner["learner-0"], by_learner["learner-1"]
            # Per inner step, so that merges where the two contributed different step counts count
            # too (equal counts depend on timing: under load there may be none).
            per_step_ratios.append(((raw["learner-0"] / a.steps) / (raw["learner-1"] / b.steps),
                                    (a.weight / a.steps) / (b.weight / b.steps)))
    assert both >= 4, [list(r.contributors) for r in state.recent_merges]
    # tokens²/steps: a 4x batch is 16x the weight (the tokens the unit reports are its whole batch), and
    # the merge keeps it once the unit's batch is checked against the small learner's history.
    assert all(r == pytest.approx(16.0) for r, _ in per_step_ratios), per_step_ratios
    assert any(w == pytest.approx(16.0) for _, w in per_step_ratios), per_step_ratios
    # The training state's influence columns count the same: the cap at most in each fragment's first
    # merges (three of the other learner's contributions check a unit's batch) and where it was clipped.
    influence = {i.learner_id: i for i in state.influence}
    for learner_id in per_step:
        assert influence[learner_id].share_capped <= 3 * len(state.fragments) + influence[learner_id].clipped, influence
    assert influence["learner-0"].max_share > 0.5 and capped < both, (influence, capped, both)
    # Nothing was refused or capped as hostile (default norm bound, weight cap, direction check); the
    # median-of-norms clip (--norm-clip-factor 4) leaves all but a few contributions whole. "slowed"
    # counts accepted uploads answered with a back-pressure hint (a loaded machine), not a refusal.
    others = {k: v for k, v in state.uploads.items()
              if k not in ("accepted", "duplicate", "clipped_norm", "slowed") and v}
    assert not others and state.uploads.get("clipped_norm", 0) <= 0.05 * state.uploads["accepted"], state.uploads
