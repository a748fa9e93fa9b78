"""The quality guard: decoupled training must keep every learner's work and train as well as classic
synchronous DiLoCo (issue 20, item 5).

One fixed configuration (tiny model, 3 learners x 240 steps x batch 64, P = 4, H = 8: 30 outer
steps per fragment, seed 0) runs classic DiLoCo and Decoupled DiLoCo through the real services with
`ddiloco bench quality`. The test fails if decoupled merges less than 90% of the work its learners
processed, or if its held-out loss is worse than DiLoCo's by more than MARGIN_PCT.

How MARGIN_PCT was calibrated: the same configuration was run at seeds 1, 2 and 3 (not the guard's
seed 0), `ddiloco bench quality --modes diloco,decoupled --ablations none --preset tiny --learners 3
--steps 240 --batch-size 64 --sync-period-steps 8 --seeds 1,2,3 --final-eval-batches 32`, at commit
80752d9 (the inner LR's cosine decay over --steps became the default there; the earlier calibration,
at 389f7fb with a constant LR, measured +1.13/+8.49/+6.20% and a 16.6% margin), from a clean worktree.
The relative gap decoupled vs DiLoCo (same seed) measured CALIBRATION_GAPS_PCT; the margin is their
mean plus three sample standard deviations, rounded up to a tenth of a percent (8.4%), so an honest
run fails by chance rarely. The noise is large at this length: decoupled rounds depend on timing,
and one seed of three differs from the others by 5 points, so the loss check only catches gross
regressions; the work-merged check is the sharp one (before the round redesign, 36-60% of the work
was merged; every calibration run merged 100% with 2.97-3.00 contributors per merge of 3).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CALIBRATION_GAPS_PCT = (0.34, -5.43, 0.26)  # seeds 1, 2, 3 (see the docstring)
MARGIN_PCT = 8.4
MIN_WORK_MERGED = 0.90


def test_margin_is_the_calibrated_one():
    gaps = CALIBRATION_GAPS_PCT
    expected = statistics.mean(gaps) + 3 * statistics.stdev(gaps)
    assert MARGIN_PCT == pytest.approx(max(0.1, round(expected + 0.05, 1)), abs=0.051)


def test_decoupled_keeps_its_work_and_trains_as_well_as_diloco(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli.main", "bench", "quality", "--modes", "diloco,decoupled",
         "--ablations", "none", "--preset", "tiny", "--learners", "3", "--steps", "240", "--batch-size", "64",
         "--sync-period-steps", "8", "--seeds", "0", "--final-eval-batches", "32", "--eval-interval-s", "60",
         "--out", str(out), "--workdir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = json.loads((out / "quality.json").read_text())["runs"]
    diloco, decoupled = runs["diloco/seed0"], runs["decoupled/seed0"]
    report = (f"decoupled {decoupled['final_heldout_loss']:.4f} vs diloco {diloco['final_heldout_loss']:.4f} "
              f"({decoupled['loss_vs_diloco_pct']:+.2f}%, margin {MARGIN_PCT}%), work merged "
              f"{decoupled['work_merged']:.3f}, contributors/merge {decoupled['contributors_per_merge_all_live']}")
    assert decoupled["work_merged"] >= MIN_WORK_MERGED, report
    assert decoupled["loss_vs_diloco_pct"] <= MARGIN_PCT, report
    assert decoupled["final_heldout_loss"] < decoupled["first_heldout_loss"] - 1.0, report
