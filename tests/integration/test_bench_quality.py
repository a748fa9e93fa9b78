"""`ddiloco bench quality --quick`: the benchmark machinery end to end (not its numbers).

Runs dp and decoupled through the real services and checks that the JSON, the markdown report and
the plot are written with every figure the issue asks for, and that the figures are consistent
with what was run (equal tokens per learner, dp moving far more bytes than decoupled, dp learners
waiting and decoupled learners not).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_quick_quality_bench_writes_a_consistent_report(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli.main", "bench", "quality", "--quick", "--modes", "dp,decoupled",
         "--ablations", "merge-mean", "--out", str(out), "--workdir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=560,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "quality.json").read_text())
    assert (out / "quality.png").stat().st_size > 10_000
    md = (out / "quality.md").read_text()
    assert "## Targets" in md and "## Ablations" in md and "Commit " in md
    runs = result["runs"]
    assert set(runs) == {"dp/seed0", "decoupled/seed0", "merge-mean/seed0"}
    tokens = {name: r["tokens_trained"] for name, r in runs.items()}
    assert len(set(tokens.values())) == 1, tokens  # equal tokens in every run
    for r in runs.values():
        assert r["final_heldout_loss"] is not None and r["final_heldout_loss"] < r["first_heldout_loss"]
        assert len(r["per_learner"]) == 2 and all(p["bytes_up"] > 0 and p["bytes_down"] > 0 for p in r["per_learner"])
        assert r["bytes_total"] == sum(p["bytes_up"] + p["bytes_down"] for p in r["per_learner"])
        assert r["link_bps_for_95pct"] > 0 and r["peak_bytes_per_step_per_learner"] >= r["bytes_per_step_per_learner"]
    dp, dec = runs["dp/seed0"], runs["decoupled/seed0"]
    assert dp["outer_steps"] == 24 and dp["wait_share"] > 0 and dec["wait_share"] == 0
    assert result["summary"]["dp_over_decoupled_bytes"] > 5
    # Every token of every learner reaches the global model (the end of training merges everything).
    assert dec["work_merged"] == pytest.approx(1.0) and dec["learners_finished_all_merged"] == 2
    assert set(result["summary"]["targets"]) == {"bytes_400x_fewer_than_dp", "work_merged_95pct"}
    assert result["summary"]["aggregate"]["decoupled"]["work_merged"]["n"] == 1
    assert result["provenance"]["cpu_count"] >= 1 and result["config"]["learners"] == 2
