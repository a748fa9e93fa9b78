"""`ddiloco simulate`: the failure model reproduces the paper's Table 1 and behaves like one should."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ddiloco.sim import cli, model

DAY_S = 86400.0


@pytest.fixture(scope="module")
def table() -> dict[tuple[str, int], model.Cell]:
    # The defaults, as `ddiloco simulate` runs them (a few seconds).
    return {(c.row, c.fleet_chips): c for c in model.goodput_table()}


def test_every_cell_within_three_points_of_the_paper(table):
    assert len(table) == 30
    misses = {k: round(c.diff_pct, 2) for k, c in table.items() if abs(c.diff_pct) > 3.0}
    assert not misses
    # The noise is far below the tolerance.
    assert max(c.stderr_pct for c in table.values()) < 0.5


def test_goodput_falls_with_fleet_size_and_rises_with_learners(table):
    rows = model.row_labels(model.PAPER_LEARNERS)
    for row in rows:
        series = [table[row, n].goodput_pct for n in model.PAPER_FLEETS]
        assert series == sorted(series, reverse=True), row
    for n in model.PAPER_FLEETS:
        decoupled = [table[f"Decoupled M={m}", n].goodput_pct for m in model.PAPER_LEARNERS]
        assert decoupled == sorted(decoupled), n
        assert table["DP, elastic", n].goodput_pct > table["DP, no elasticity", n].goodput_pct
        assert table["Decoupled M=2", n].goodput_pct > table["DP, elastic", n].goodput_pct
        assert table["Decoupled M=4", n].uptime_pct > 99.0


def test_same_seed_same_numbers_other_seed_other_numbers():
    args = dict(row="Decoupled M=4", fleet_chips=600_000, sim_s=3 * DAY_S)
    a = model.simulate_cell(model.FleetModel(), seed=7, **args)
    b = model.simulate_cell(model.FleetModel(), seed=7, **args)
    c = model.simulate_cell(model.FleetModel(), seed=8, **args)
    assert a == b
    assert a.goodput_pct != c.goodput_pct
    assert abs(a.goodput_pct - c.goodput_pct) < 6 * math.hypot(a.stderr_pct, c.stderr_pct)


def test_no_failures_means_full_goodput():
    fleet = model.FleetModel(chip_mtbi_s=math.inf)
    cells = model.goodput_table(fleet, fleets=(150_000, 2_400_000), learners=(2, 16), sim_s=DAY_S)
    assert all(c.goodput_pct == 100.0 and c.uptime_pct == 100.0 and c.failures == 0 for c in cells)
    ours = model.ours_table(model.OursConfig(learners=(2,), learner_mtbf_s=(math.inf,), syncer_mtbf_s=math.inf,
                                             chip_mtbi_s=math.inf), sim_s=DAY_S)
    assert [(c.decoupled_pct, c.synchronous_pct) for c in ours] == [(100.0, 100.0)]


def test_dp_row_equals_the_laplace_transform_of_the_restart_delay():
    # With a restart that a failure re-starts and nothing else lost, goodput is exactly
    # P(a restart completes before the next failure) = E[exp(-rate * D)]: checks the event loop.
    fleet = model.FleetModel()
    delays_s = fleet.dp_restart.quantile_s((np.arange(200_000) + 0.5) / 200_000)
    for chips in (300_000, 2_400_000):
        rate = chips / fleet.chip_mtbi_s
        exact = float(np.exp(-rate * delays_s).mean())
        sim = model.simulate_unit(fleet.restart_unit(), rate, 100_000 / rate, np.random.default_rng(1))
        assert abs(sim.goodput - exact) < 4 * sim.stderr + 1e-3, (chips, sim.goodput, exact)


def test_lost_work_since_the_last_fragment_sync():
    # Instant restarts: the only loss is the work since each fragment's last sync (period S),
    # E[u - u^2/2S for u < S, else S/2] per failure, u ~ Exp(rate).
    rate, period_s = 1 / 100.0, 30.0
    unit = model.RestartUnit(model.ExpWeibull(0.0), save_period_s=period_s, saves_staggered=True)
    sim = model.simulate_unit(unit, rate, 40_000 / rate, np.random.default_rng(2))
    u = np.linspace(0, period_s, 200_001)
    lost = np.trapezoid((u - u * u / (2 * period_s)) * rate * np.exp(-rate * u), u)
    lost += period_s / 2 * math.exp(-rate * period_s)
    assert abs(sim.goodput - (1 - rate * lost)) < 4 * sim.stderr + 1e-3


def test_exponentiated_weibull_sampling():
    dist = model.ExpWeibull(10.0, 0.8, 1.1)
    x = dist.sample_s(np.random.default_rng(3), 400_000)
    assert abs(x.mean() / dist.mean_s() - 1) < 0.02
    assert abs(np.median(x) / dist.quantile_s(0.5) - 1) < 0.02
    # CDF(quantile(q)) == q
    q = np.array([0.1, 0.5, 0.9, 0.999])
    cdf = (1 - np.exp(-((dist.quantile_s(q) / 10.0) ** 0.8))) ** 1.1
    np.testing.assert_allclose(cdf, q, rtol=1e-9)
    assert abs(model.ExpWeibull.with_mean(15.0).mean_s() - 15.0) < 1e-6


def test_ours_decoupled_beats_lockstep_and_does_not_degrade_with_learners():
    cfg = model.OursConfig(learners=(2, 8), learner_mtbf_s=(600.0,))
    cells = {(c.learners, c.learner_mtbf_s): c for c in model.ours_table(cfg, sim_s=20 * DAY_S)}
    two, eight = cells[2, 600.0], cells[8, 600.0]
    assert eight.decoupled_pct > eight.synchronous_pct and two.decoupled_pct > two.synchronous_pct
    assert eight.synchronous_pct < two.synchronous_pct
    assert abs(eight.decoupled_pct - two.decoupled_pct) < 0.5


def test_cli_writes_json_markdown_and_plot(tmp_path, capsys):
    rc = cli.main(["--out", str(tmp_path), "--sim-days", "2", "--fleets", "150k,1.2M", "--learners", "2,8",
                   "--our-learners", "2,4", "--our-mtbf-s", "600", "--seed", "3"])
    assert rc == 0
    result = json.loads((tmp_path / "simulate.json").read_text())
    assert len(result["cells"]) == 4 * 2
    assert result["paper_comparison"]["cells_compared"] == 8
    assert result["constants"]["dp_restart"]["scale_s"] == model.DP_RESTART_SCALE_S
    assert len(result["ours"]["cells"]) == 2 * 2  # 600 s and 1 year per chip / 4 chips
    md = (tmp_path / "simulate.md").read_text()
    assert "## What it implies for us" in md and "## Calibrated constants" in md and "Decoupled M=8" in md
    assert (tmp_path / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "max |simulated - paper|" in capsys.readouterr().out
