"""Bounded influence end to end (issue 24): three honest learners and one that sends Gaussian noise
of 10x its own pseudo-gradient's norm while claiming 4x the steps and a 20x batch
(`python -m ddiloco.chaos.hostile_learner --hostile noise:10 --claim-steps 4 --claim-batch 20`),
against the syncer's shipped defaults, real processes on 127.0.0.1, the tiny model.

Before the bounds, this learner's weight was up to 1,600x an honest one's and the merged update
followed it: `ddiloco bench hostile`'s `noise-claims-undefended` case runs the same attack with the
old settings (no share cap, a batch up to 20x the median, no median-of-norms clipping) and is
where the assertions below are shown to fail (bench/results/hostile.md). Asserted here, from the
merge ledger: its claims are clipped (steps to what the syncer observed, the batch to 4x the
others' median), its share of any merge of two or more is at most the cap (its claims were
clipped; honest learners are capped only in merges of three or more), the merged update's
norm stays within a small factor of the honest contributions' and the honest contributions keep
pointing the merged update's way; no honest learner is quarantined, and `ddiloco audit` names the
hostile learner.
"""

from __future__ import annotations

import pytest

from ddiloco.bench import hostile as hostile_bench
from ddiloco.cli import audit as audit_lib

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

HOSTILE = "learner-3"
SHARE_CAP = 0.5  # --max-merge-share's default
# Over the merges of two or more that the hostile learner is in (bench/results/hostile.md). With the
# share cap at 1/2 and norms clipped at 4x the median, RDA's merged norm is at most about
# 1/2 x 1 + 1/2 x 4 = 2.5x an honest one (measured: median 2.1 and 2.5 in two invocations, largest
# 8.5-11, at the start of a run; undefended: 3.5-7.5 and 250-300 at most); the honest
# contributions' mean cosine with the merged update was 0.49-0.56 (undefended 0.005-0.009: the
# noise was the merge, at a share of 0.99).
MAX_NORM_RATIO = 4.0  # merged norm / median honest norm in the merge, median over merges
MAX_NORM_RATIO_ANY = 25.0  # ... in any one merge
MIN_HONEST_COSINE = 0.3  # honest contributions' mean cosine with the merged update, median over merges


def test_a_noisy_learner_with_inflated_claims_does_not_take_over_a_merge(tmp_path):
    run = hostile_bench.run_case(tmp_path / "attack", hostile_bench.NOISE_CLAIMS, learners=4, steps=100)
    records = run["ledger"]
    m = hostile_bench.measure(run, HOSTILE)
    report = {k: m[k] for k in ("loss", "merges", "merges_compared", "hostile_max_share", "merged_norm_ratio",
                                "merged_norm_ratio_max", "honest_cosine", "hostile_quarantined", "honest_quarantined",
                                "hostile_accepted", "hostile_rejections", "honest_clipped")}
    mine = [c for r in records for c in r["contributors"] if c["learner"] == HOSTILE]
    refused = [x for r in records for x in r["refused"] if x["learner"] == HOSTILE]
    assert mine or refused, report  # it took part
    # Its claims never count in full: 4x the steps are cut to what the syncer observed, and once
    # other learners' contributions exist, the 20x batch to 4x their median.
    for c in mine:
        assert c["steps"] < c["claimed_steps"] and "steps" in c["clipped"], c
        assert c["weight"] <= c["claimed_weight"] / 4 * (1 + 1e-6), c  # the steps' share of the claim
        if "batch" in c["clipped"]:  # 20x the batch cut to 4x: weight per step 400x -> 16x
            assert c["weight"] <= c["claimed_weight"] / 100, c
    # Its share of any merge of two or more contributions is at most the cap (its claims were
    # clipped, so the cap applies in merges of two as well); anyone's in merges of three or more.
    for r in records:
        for c in r["contributors"]:
            if len(r["contributors"]) >= 3 or (c["learner"] == HOSTILE and len(r["contributors"]) == 2):
                assert c["share"] <= SHARE_CAP + 1e-6, (r["fragment"], r["version"], c)
                assert c["fold"]["claims_unverified"] or c["learner"] != HOSTILE, c
    # Where it was merged with honest learners, the merged update stays near theirs.
    assert m["merges_compared"] >= 5, report  # merged with honest learners, so the bounds are tested
    if m["merges_compared"]:
        assert m["merged_norm_ratio"] <= MAX_NORM_RATIO, report
        assert m["merged_norm_ratio_max"] <= MAX_NORM_RATIO_ANY, report
        assert m["honest_cosine"] >= MIN_HONEST_COSINE, report
    assert m["honest_quarantined"] == 0, report
    # The ledger names it: flagged by the audit, and no honest learner is flagged for its share.
    flags = audit_lib.influence(records)
    assert flags[HOSTILE]["flags"], (report, flags[HOSTILE])
    assert not any("share capped" in f for lid, e in flags.items() if lid != HOSTILE for f in e["flags"]), flags
