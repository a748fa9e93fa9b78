"""`ddiloco bench goodput`: the paper's goodput, the tokens merged share and the seeds' aggregate,
from synthetic runs (no processes)."""

from __future__ import annotations

import argparse
import json
import pathlib
from types import SimpleNamespace

import pytest

from ddiloco.bench import goodput

pytestmark = pytest.mark.timeout(60)


def test_half_the_processed_tokens_merged_at_the_fault_free_speed_is_half_goodput():
    # 4 learners, 4 fragments. Fault-free: 4 x 1,000 tokens/s for 100 s = 400,000 tokens processed.
    # Faulty run: also 100 s of wall time, and half of the work reached the global model: 200,000
    # model tokens = 800,000 fragment-tokens (each inner step's tokens count once per fragment).
    f = goodput.goodput_figures(learners=4, fragments=4, tokens_merged=800_000, wall_s=100.0,
                                baseline_tokens_processed=400_000, baseline_wall_s=100.0)
    assert f["model_tokens_merged"] == 200_000
    assert f["fault_free_rate"] == 1_000.0
    assert f["capacity_tokens"] == 400_000
    assert f["goodput"] == pytest.approx(0.5)
    # All merged, but the faults doubled the wall time: half of the allocated capacity was useful.
    f = goodput.goodput_figures(learners=4, fragments=4, tokens_merged=1_600_000, wall_s=200.0,
                                baseline_tokens_processed=400_000, baseline_wall_s=100.0)
    assert f["goodput"] == pytest.approx(0.5)
    # dp: one fragment, fragment-tokens are model tokens.
    f = goodput.goodput_figures(learners=2, fragments=1, tokens_merged=1_500, wall_s=10.0,
                                baseline_tokens_processed=2_000, baseline_wall_s=10.0)
    assert f["goodput"] == pytest.approx(0.75)
    # Unknown wall times or nothing processed: no figure, never a division by zero.
    for kw in ({"wall_s": None}, {"baseline_wall_s": None}, {"baseline_tokens_processed": 0}):
        args = {"learners": 2, "fragments": 1, "tokens_merged": 1, "wall_s": 1.0,
                "baseline_tokens_processed": 1, "baseline_wall_s": 1.0} | kw
        assert goodput.goodput_figures(**args)["goodput"] is None


def _result(*, t0: float, end: float, finished: dict, processed: int, merged: int, fragments: int, learners: int = 2,
            stopped_at: float | None = None, ok: bool = True):
    """A harness Result as far as _summary reads it (final_state as MessageToDict gives it: uint64 as str)."""
    return SimpleNamespace(
        ok=ok, violations=lambda: [], report_line="line", faults=[], not_injected=[], t0=t0,
        training_end=end if stopped_at is None else 0.0, stopped_at=end if stopped_at is None else stopped_at,
        learner_finished_at=finished, scenario=SimpleNamespace(learners=learners, num_fragments=4),
        summaries={"learner-0": {"wait_s": 1.0, "compute_s": 3.0}, "learner-1": None},
        final_state={"tokens_processed": str(processed), "tokens_merged": str(merged),
                     "fragments": [{}] * fragments},
        syncer_history=[{"event": "start", "fragments": {str(i): [0, "", ""] for i in range(fragments)}}],
        loss=2.5, recoveries=[1.0])


def test_summary_of_a_run_reads_the_syncers_token_counters():
    # Fault-free: 2 learners, 50 s, 100,000 tokens processed, all merged (4 fragments).
    baseline = _result(t0=1000.0, end=1050.0, finished={"learner-0": 1050.0, "learner-1": 1050.0},
                       processed=100_000, merged=400_000, fragments=4)
    # Faulty: 80 s, 110,000 processed (a restart redid steps), 90,000 model tokens merged.
    faulty = _result(t0=2000.0, end=2080.0, finished={"learner-0": 2060.0, "learner-1": 2080.0},
                     processed=110_000, merged=360_000, fragments=4)
    s = goodput._summary(faulty, baseline)
    assert s["wall_s"] == 80.0 and s["baseline_wall_s"] == 50.0
    assert s["fault_free_rate"] == pytest.approx(100_000 / (2 * 50.0))
    assert s["model_tokens_merged"] == 90_000
    assert s["goodput"] == pytest.approx(90_000 / (2 * 1_000 * 80.0))
    assert s["baseline_goodput"] == pytest.approx(1.0)
    assert s["tokens_merged_share"] == pytest.approx(360_000 / (4 * 110_000))
    assert s["baseline_tokens_merged_share"] == pytest.approx(1.0)
    # The secondary figure keeps the old computation under its own name.
    assert s["slowdown_ratio"] == pytest.approx((50.0 + 50.0) / (60.0 + 80.0))
    assert s["slowdown_ratio_at_most"] is None and s["finished"] and not s["stopped"]
    assert s["learner_wait_fraction"] == pytest.approx(0.25)
    assert "goodput_time" not in s

    # A run stopped at the wall limit: goodput over the time until the stop, the slowdown ratio a bound.
    stopped = _result(t0=2000.0, end=0.0, stopped_at=2100.0, finished={"learner-0": 2060.0},
                      processed=80_000, merged=200_000, fragments=4)
    s = goodput._summary(stopped, baseline)
    assert s["wall_s"] == 100.0 and not s["finished"] and s["stopped"] and s["stopped_after_s"] == 100.0
    assert s["goodput"] == pytest.approx(50_000 / (2 * 1_000 * 100.0))
    assert s["slowdown_ratio"] is None and s["slowdown_ratio_at_most"] == pytest.approx(100.0 / 160.0)


def test_goodput_against_the_decoupled_rate_charges_a_modes_fault_free_waits():
    modes = {"decoupled": {"fault_free_rate": 1_000.0, "capacity_tokens": 100_000.0, "model_tokens_merged": 90_000.0},
             # dp's learners process half as fast without faults (barrier waits).
             "dp": {"fault_free_rate": 500.0, "capacity_tokens": 50_000.0, "model_tokens_merged": 40_000.0}}
    goodput.add_decoupled_rate(modes)
    assert modes["decoupled"]["goodput_vs_decoupled_rate"] == pytest.approx(0.9)
    assert modes["dp"]["goodput_vs_decoupled_rate"] == pytest.approx(0.4)
    only_dp = {"dp": dict(modes["dp"])}
    goodput.add_decoupled_rate(only_dp)
    assert only_dp["dp"]["goodput_vs_decoupled_rate"] is None


def test_seeds_aggregate_to_mean_and_spread_per_mode():
    def row(g, ratio, share, ok=True, finished=True):
        return {"goodput": g, "slowdown_ratio": ratio if finished else None,
                "slowdown_ratio_at_most": None if finished else ratio, "tokens_merged_share": share,
                "baseline_tokens_merged_share": 1.0, "baseline_goodput": 1.0, "goodput_vs_decoupled_rate": g,
                "learner_wait_fraction": 0.1, "faults_injected": 3, "ok": ok, "finished": finished,
                "stopped": not finished}

    runs = [{"seed": 0, "modes": {"decoupled": row(0.90, 0.95, 0.97), "dp": row(0.40, 0.45, 1.0)}},
            {"seed": 1, "modes": {"decoupled": row(0.86, 0.93, 0.95), "dp": row(0.30, 0.35, 1.0, ok=False)}},
            {"seed": 2, "modes": {"decoupled": row(0.88, 0.94, 0.96), "dp": row(0.20, 0.30, 1.0, finished=False)}}]
    agg = goodput.aggregate(runs)
    d = agg["decoupled"]
    assert d["seeds"] == [0, 1, 2] and d["ok"] and d["stopped"] == 0
    assert d["goodput"]["mean"] == pytest.approx(0.88)
    assert (d["goodput"]["min"], d["goodput"]["max"], d["goodput"]["n"]) == (0.86, 0.90, 3)
    assert d["goodput"]["std"] == pytest.approx((0.0008 / 3) ** 0.5)
    assert d["goodput"]["values"] == [0.90, 0.86, 0.88]
    dp = agg["dp"]
    assert not dp["ok"] and dp["stopped"] == 1
    assert dp["goodput"]["mean"] == pytest.approx(0.30)
    # The stopped run's slowdown ratio is only a bound: left out of the mean, kept apart.
    assert dp["slowdown_ratio"]["n"] == 2 and dp["slowdown_ratio"]["mean"] == pytest.approx(0.40)
    assert dp["slowdown_ratio_at_most"]["values"] == [None, None, 0.30]
    assert goodput.spread([None, None]) == {"mean": None, "min": None, "max": None, "std": None, "n": 0,
                                            "values": [None, None]}
    assert goodput._spread_cell(d["goodput"], bold=True) == "**88.0 %** (86.0-90.0, std 1.6)"
    assert goodput._spread_cell(goodput.spread([0.5])) == "50.0 %"
    # A run without the figure (e.g. the schedule never started) is said, not hidden.
    assert goodput._spread_cell(goodput.spread([0.5, None])) == "50.0 % (1 of 2 runs)"
    assert goodput._spread_cell(goodput.spread([0.5, 0.7, None])) == "60.0 % (50.0-70.0, std 10.0, 2 of 3 runs)"


def test_seeds_flag_parses_and_refuses_duplicates():
    assert goodput.parse_seeds("0,1,2") == [0, 1, 2]
    assert goodput.parse_seeds(" 3 ") == [3]
    for bad in ("", "1,1", "a"):
        with pytest.raises(ValueError):
            goodput.parse_seeds(bad)
    parser = argparse.ArgumentParser()
    goodput.add_arguments(parser)
    args = parser.parse_args(["--seeds", "0,1,2", "--mtbf-steps", "30"])
    assert args.seeds == "0,1,2" and args.mtbf_steps == 30.0


def _synthetic_out() -> dict:
    cfg = goodput.GoodputConfig(learners=2, steps=100, mtbf_steps=20, start_step=10)
    runs = []
    for seed in (0, 1):
        modes = {}
        for mode, g in (("decoupled", 0.9), ("dp", 0.4)):
            modes[mode] = {
                "ok": True, "violations": [], "report": f"{mode} line", "baseline_report": "b", "faults_injected": 2,
                "not_injected": 0, "faults": [], "finished": True, "stopped_after_s": None, "goodput": g + seed / 100,
                "model_tokens_merged": 9_000.0, "fault_free_rate": 50.0, "capacity_tokens": 10_000.0,
                "wall_s": 100.0, "baseline_wall_s": 90.0, "tokens_processed": 10_000, "tokens_merged": 36_000,
                "num_fragments": 4 if mode == "decoupled" else 1, "baseline_tokens_processed": 9_000,
                "baseline_tokens_merged": 36_000, "baseline_goodput": 1.0, "tokens_merged_share": 0.9,
                "baseline_tokens_merged_share": 1.0, "slowdown_ratio": 0.9, "slowdown_ratio_at_most": None,
                "learner_s": 200.0, "baseline_learner_s": 180.0, "training_s": 100.0, "baseline_training_s": 90.0,
                "learner_wait_fraction": 0.1, "loss": 3.0, "baseline_loss": 2.9, "recovery_s": [1.0]}
        goodput.add_decoupled_rate(modes)
        runs.append({"seed": seed, "schedule": [{"at_step": 30, "target": "learner-1", "kind": "kill", "t": 0.0,
                                                 "params": {"restart_after_s": 1.0}}], "modes": modes})
    return {"config": goodput.dataclasses.asdict(cfg), "seeds": [0, 1], "fault_rate": {"mtbf_steps": 20.0},
            "definitions": goodput.DEFINITIONS, "provenance": {"argv": ["ddiloco", "bench", "goodput"]},
            "runs": runs, "modes": {}}


def test_report_states_the_fault_rate_and_how_each_figure_is_computed(tmp_path: pathlib.Path):
    out = _synthetic_out()
    assert goodput._write(out, tmp_path / "out", tmp_path / "work") == 0
    written = json.loads((tmp_path / "out" / "goodput.json").read_text())
    assert written["modes"]["decoupled"]["goodput"]["mean"] == pytest.approx(0.905)
    assert set(goodput.DEFINITIONS) <= set(written["definitions"])
    md = (tmp_path / "out" / "goodput.md").read_text()
    assert "MTBF 20 inner steps" in md and "fixed before running" in md
    # The old figure appears under its own name only (the definition says what it was called before).
    assert "slowdown ratio" in md and md.count("goodput (time)") == md.count("formerly called 'goodput (time)'") == 1
    assert "tokens merged into the global model / (learners x fault-free per-learner token rate" in md
    assert "**90.5 %** (90.0-91.0, std 0.5)" in md
    assert "### Seed 0" in md and "### Seed 1" in md
    assert (tmp_path / "out" / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --render-only rewrites the same report from the JSON; a pre---seeds JSON is refused.
    assert goodput._render_only(tmp_path / "out", tmp_path / "work") == 0
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "goodput.json").write_text(json.dumps({"config": {}, "modes": {}}))
    assert goodput._render_only(tmp_path / "old", tmp_path / "work") == 2


def test_contributors_per_merge_counts_distinct_learners_of_each_merge_over_the_runs_learners():
    history = [{"event": "start", "fragments": {}},
               {"event": "merged", "contributors": [["learner-0", 1, 0, 10], ["learner-1", 1, 0, 10]]},
               {"event": "merged", "contributors": [["learner-0", 1, 1, 10], ["learner-0", 1, 1, 5]]},
               {"event": "accepted"}]
    run = SimpleNamespace(syncer_history=history, scenario=SimpleNamespace(learners=4))
    assert goodput.contributors_per_merge(run) == pytest.approx((2 + 1) / 2 / 4)
    assert goodput.contributors_per_merge(SimpleNamespace(syncer_history=history[:1],
                                                          scenario=SimpleNamespace(learners=4))) is None


def test_every_mode_runs_the_shipped_syncer_defaults_of_its_sync_mode():
    cfg = goodput.GoodputConfig(run_end="steps")
    assert goodput.mode_scenario(cfg, "decoupled").syncer_args == ("--sync-mode", "decoupled")
    assert goodput.mode_scenario(cfg, "decoupled").kill_scope == "learner"
    for mode in ("diloco", "dp", "diloco-job", "dp-job"):
        scenario = goodput.mode_scenario(cfg, mode)
        # Only the mode: what clips or refuses beyond the norm bound is the preset's (diloco clips).
        assert scenario.syncer_args == ("--sync-mode", goodput.base_mode(mode))
        assert scenario.min_quorum == cfg.learners
        assert scenario.steps == cfg.steps
        # -job: the paper's "DP, no elasticity" (a kill relaunches every learner); else only the killed one.
        assert scenario.kill_scope == ("job" if mode.endswith("-job") else "learner")
    # The default invocation is the paper's comparison; the forgiving baselines are opt-in.
    assert goodput.DEFAULT_MODES == ("decoupled", "diloco-job", "dp-job")


def test_budget_runs_end_at_the_fleets_tokens_for_every_mode_alike():
    cfg = goodput.GoodputConfig()  # the default: the paper's fleet-wide budget
    assert cfg.run_end == "budget"
    # 16 learners x 300 steps x 16 sequences x 32 tokens (the tiny preset's sequence length).
    assert goodput.token_budget(cfg) == 16 * 300 * 16 * 32
    for mode in goodput.MODES:
        scenario = goodput.mode_scenario(cfg, mode)
        args = scenario.syncer_args
        assert args[args.index("--token-budget") + 1] == str(goodput.token_budget(cfg))
        assert scenario.steps == goodput.BUDGET_STEP_CAP * cfg.steps  # the learner's own limit never binds
        assert scenario.learner_args == ("--batch-size", "16")
    md = goodput.render_markdown({**_synthetic_out(), "modes": {}, "config": goodput.dataclasses.asdict(cfg)})
    assert "fleet token budget of 16 x 300 inner steps' tokens" in md


def test_every_mode_runs_the_syncers_shipped_liveness_and_grace_cap_and_the_report_says_which():
    from ddiloco.chaos import harness
    from services.syncer import config as syncer_config

    cfg = goodput.GoodputConfig()
    for mode in goodput.MODES:
        scenario = goodput.mode_scenario(cfg, mode)
        # No flag reaches the syncer: it runs its own defaults, whatever they are.
        assert harness.timeout_args(scenario) == []
        assert not {"--liveness-timeout-s", "--max-grace-s"} & set(scenario.syncer_args)
    # The chaos rows keep their shortened timeouts.
    assert harness.timeout_args(harness.Scenario()) == ["--liveness-timeout-s", "3.0", "--max-grace-s", "2.0"]
    # The report takes the values from what each syncer recorded at start (syncer_settings).
    shipped = syncer_config.SyncerConfig()
    out = _synthetic_out()
    out["config"] = goodput.dataclasses.asdict(cfg)
    for run in out["runs"]:
        for m in run["modes"].values():
            m["syncer_settings"] = {"liveness_timeout_s": shipped.liveness_timeout_s, "max_grace_s": shipped.max_grace_s}
    md = goodput.render_markdown(out)
    assert (f"Every mode runs the syncer's shipped liveness timeout ({shipped.liveness_timeout_s:g} s) and, in the "
            f"decoupled mode, grace cap ({shipped.max_grace_s:g} s;" in md)
    # A run given other values says so, with the values recorded.
    out["config"] = goodput.dataclasses.asdict(goodput.GoodputConfig(liveness_timeout_s=3.0, max_grace_s=2.0))
    for run in out["runs"]:
        for m in run["modes"].values():
            m["syncer_settings"] = {"liveness_timeout_s": 3.0, "max_grace_s": 2.0}
    md = goodput.render_markdown(out)
    assert "runs with a liveness timeout (3 s) and, in the decoupled mode, grace cap (2 s;" in md
    assert "(`--liveness-timeout-s`, `--max-grace-s`), not the shipped defaults" in md
    assert "shipped liveness" not in md
