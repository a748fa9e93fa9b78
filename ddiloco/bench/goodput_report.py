"""The goodput benchmark's report: how each figure is computed (DEFINITIONS, written into goodput.json
and goodput.md next to the numbers), the markdown tables and text of goodput.md, and goodput.png.
Split out of ddiloco/bench/goodput.py, which runs the modes and re-exports these names."""

from __future__ import annotations

import pathlib

from ddiloco.bench import results as results_lib

# How each number of goodput.json / goodput.md is computed (written into both, next to the numbers).
DEFINITIONS = {
    "goodput": "tokens merged into the global model / (learners x fault-free per-learner token rate x wall "
               "time of the faulty run): useful work over allocated capacity (the paper's goodput)",
    "model_tokens_merged": "TrainingState.tokens_merged / num_fragments at the end of the run (tokens_merged "
                           "counts each inner step's tokens once per fragment its contribution reached; "
                           "/ num_fragments gives model tokens; dp has 1 fragment)",
    "fault_free_rate": "fault-free per-learner token rate, tokens/s: TrainingState.tokens_processed of the same "
                       "mode's fault-free run (same seed, whole run) / (learners x that run's wall time). Warm-up "
                       "tokens (before the schedule's start) are in it, as they are in the faulty run's tokens "
                       "merged: a capacity scale for the same work, above the steady per-step speed",
    "wall_s": "wall time of a run: from the schedule's start (every learner has contributed) until the last "
              "learner finished (budget runs: once the syncer said the fleet's token budget was processed; steps "
              "runs: its own steps) and its remaining progress was merged, or the stop at --max-wall-s",
    "goodput_vs_decoupled_rate": "goodput with the decoupled mode's fault-free rate (same seed) as every mode's "
                                 "capacity: also charges a mode its fault-free waits",
    "baseline_goodput": "the fault-free run's goodput against its own rate (= its tokens merged share)",
    "slowdown_ratio": "sum over learners of the fault-free time to finish / the same sum under the faults, each "
                      "learner from the schedule's start until it finished (formerly called 'goodput (time)')",
    "tokens_merged_share": "tokens_merged / (num_fragments x tokens_processed) of the faulty run (baseline_: of "
                           "the fault-free run): the share of processed work that reached the global model",
    "learner_wait_fraction": "time learners spent blocked on the syncer / (blocked + computing), faulty run",
    "contributors_per_merge": "mean over the run's merges (syncer history) of the learners a merge held / the "
                              "learners of the run (fault-free: all of them live until they finish; the last "
                              "merges of a run, after learners finished, hold fewer)",
    "aggregate": "per mode over the seeds: mean, min, max and population std of each run's figure",
}


def _seconds(faulty: float | None, fault_free: float | None) -> str:
    return f"{faulty:.0f} s ({fault_free:.0f} s)" if faulty is not None and fault_free is not None else "-"


def _pct(v: float | None) -> str:
    return f"{100 * v:.1f} %" if v is not None else "-"


def _slowdown_cell(r: dict) -> str:
    if r.get("slowdown_ratio") is not None:
        return _pct(r["slowdown_ratio"])
    if r.get("slowdown_ratio_at_most") is not None:
        stop = r.get("stopped_after_s")
        where = f" (stopped {stop:.0f} s into the schedule)" if stop else ""
        return f"<= {_pct(r['slowdown_ratio_at_most'])}{where}"
    return "-"


def _spread_cell(s: dict, bold: bool = False) -> str:
    """'mean (min-max)' in percent over the seeds."""
    if not s or s.get("mean") is None:
        return "-"
    mean = f"**{_pct(s['mean'])}**" if bold else _pct(s["mean"])
    of = f", {s['n']} of {len(s['values'])} runs" if s["n"] < len(s["values"]) else ""
    if s["n"] == 1:
        return f"{mean} (1 of {len(s['values'])} runs)" if of else mean
    return f"{mean} ({100 * s['min']:.1f}-{100 * s['max']:.1f}, std {100 * s['std']:.1f}{of})"


def _settings_text(cfg: dict, runs: list[dict]) -> str:
    """The liveness timeout and grace cap the modes ran with, as the syncers recorded them at start."""
    if "liveness_timeout_s" not in cfg:  # a run from before these settings were configurable
        from ddiloco.chaos.harness import Scenario

        sc = Scenario()
        return (f"Every mode runs with the chaos harness's liveness timeout ({sc.liveness_timeout_s:g} s) and grace "
                f"cap ({sc.max_grace_s:g} s) instead of the syncer's shipped defaults: a dead learner stops "
                f"counting for a barrier after {sc.liveness_timeout_s:g} s, so the synchronous baselines are elastic "
                f"(the paper's 'DP, elastic' rather than its 'no elasticity' row).")

    def recorded(key: str, modes=None) -> str:
        values = sorted({m["syncer_settings"][key] for run in runs for mode, m in run["modes"].items()
                         if key in m.get("syncer_settings", {}) and (modes is None or mode in modes)})
        return " / ".join(f"{v:g} s" for v in values) or "not recorded"

    liveness, grace = recorded("liveness_timeout_s"), recorded("max_grace_s", ("decoupled",))
    shipped = cfg["liveness_timeout_s"] is None and cfg["max_grace_s"] is None
    values = (f"liveness timeout ({liveness}) and, in the decoupled mode, grace cap ({grace}; the synchronous "
              f"modes have no grace window), as each syncer recorded at start")
    if not shipped:
        return f"Every mode runs with a {values} (`--liveness-timeout-s`, `--max-grace-s`), not the shipped defaults."
    return (f"Every mode runs the syncer's shipped {values}: no hang of the schedule (at most {cfg['max_fault_s']:g} "
            f"s) outlasts the liveness timeout, so the synchronous baselines wait for a hung learner to come back "
            f"and for a killed one until its restart rejoins or the timeout passes. In the -job modes a kill "
            f"restarts every learner (the paper's 'DP, no elasticity': a synchronous job relaunched as a whole); "
            f"in diloco and dp only the killed learner restarts while the others wait for it.")


def _shape_text(cfg: dict) -> str:
    if cfg.get("run_end", "steps") == "steps":
        return f"{cfg['learners']} learners x {cfg['steps']} inner steps each"
    return (f"{cfg['learners']} learners, the run ending at a fleet token budget of {cfg['learners']} x {cfg['steps']} "
            f"inner steps' tokens (syncer `--token-budget`, batch {cfg['batch_size']}): each learner trains until the "
            f"syncer says the fleet processed it, so a learner set back by faults does not hold the run's end")


def _fault_rate_text(cfg: dict) -> str:
    window = max(0, cfg["steps"] - 20 - cfg["start_step"])
    return (f"MTBF {cfg['mtbf_steps']:g} inner steps (`--mtbf-steps {cfg['mtbf_steps']:g}`): one learner fault per "
            f"{cfg['mtbf_steps']:g} steps of training progress on average, fleet-wide, exponential gaps, between "
            f"step {cfg['start_step']} and step {cfg['steps'] - 20} (~{window / cfg['mtbf_steps']:.1f} faults expected "
            f"per run); fixed before running, the same for every seed and every mode")


def _run_table(run: dict) -> str:
    rows = []
    for mode, r in run["modes"].items():
        known = r["loss"] is not None and r["baseline_loss"] is not None
        loss = f"{r['loss']:.3f} ({r['baseline_loss']:.3f})" if known else "-"
        rate = f"{r['fault_free_rate']:,.0f}" if r.get("fault_free_rate") else "-"
        merged = f"{r['model_tokens_merged']:,.0f}" if r.get("model_tokens_merged") is not None else "-"
        rows.append([mode, f"{r['faults_injected']} (+{r['not_injected']} not)", f"**{_pct(r.get('goodput'))}**",
                     merged, rate, _seconds(r.get("wall_s"), r.get("baseline_wall_s")),
                     _slowdown_cell(r),
                     f"{_pct(r.get('tokens_merged_share'))} ({_pct(r.get('baseline_tokens_merged_share'))})",
                     _pct(r.get("learner_wait_fraction")),
                     f"{_pct(r.get('contributors_per_merge'))} ({_pct(r.get('baseline_contributors_per_merge'))})",
                     _seconds(r.get("time_to_tokens_s"), r.get("baseline_time_to_tokens_s")),
                     loss, "PASS" if r["ok"] else "FAIL"])
    target = run.get("tokens_target")
    return results_lib.markdown_table(
        ["mode", "faults", "goodput", "model tokens merged", "fault-free rate (tokens/s/learner)",
         "wall time (fault-free)", "slowdown ratio", "tokens merged share (fault-free)", "learner wait",
         "contributors per merge / learners (fault-free)", f"time to {target:,.0f} merged tokens (fault-free)" if target else "time to merged tokens",
         "final loss (fault-free)", "invariants"], rows)


def _schedule_table(schedule: list[dict]) -> str:
    return "| at step | learner | fault | heal |\n|---|---|---|---|\n" + "\n".join(
        f"| {e['at_step']} | {e['target']} | {e['kind']} | "
        + (f"restart after {e['params'].get('restart_after_s')} s" if e["kind"] == "kill"
           else f"SIGCONT after {e['params'].get('duration_s')} s") + " |"
        for e in schedule)


def render_markdown(result: dict) -> str:
    cfg = result["config"]
    seeds = result["seeds"]
    agg_rows = [[mode, ", ".join(map(str, a["seeds"])), _spread_cell(a["goodput"], bold=True),
                 _spread_cell(a["slowdown_ratio"]), _spread_cell(a["tokens_merged_share"]),
                 _spread_cell(a["baseline_tokens_merged_share"]), _spread_cell(a["baseline_contributors_per_merge"]),
                 _spread_cell(a["goodput_vs_decoupled_rate"]),
                 "/".join(str(v) for v in a["faults_injected"]["values"]),
                 ("PASS" if a["ok"] else "FAIL") + (f", {a['stopped']} stopped" if a["stopped"] else "")]
                for mode, a in result["modes"].items()]
    headline = results_lib.markdown_table(
        ["mode", "seeds", "goodput", "slowdown ratio", "tokens merged share", "tokens merged share, fault-free",
         "contributors per merge / learners, fault-free", "goodput vs decoupled's fault-free rate", "faults per seed", "invariants"], agg_rows)
    d = result.get("definitions", DEFINITIONS)
    per_seed = "\n\n".join(
        f"### Seed {run['seed']}\n\n{_run_table(run)}\n\n"
        f"<details><summary>Schedule of seed {run['seed']}: {len(run['schedule'])} learner faults</summary>\n\n"
        f"{_schedule_table(run['schedule'])}\n\n</details>\n\n"
        "Report lines (faulty runs):\n\n" + "\n".join(f"- `{r['report']}`" for r in run["modes"].values())
        for run in result["runs"])
    return (
        f"# Goodput under failures: decoupled vs synchronous DiLoCo vs data-parallel\n\n"
        f"{_shape_text(cfg)} (tiny transformer, step pacing "
        f"{cfg['step_delay_s']} s, {cfg['num_fragments']} fragments, H = {cfg['sync_period_steps']}), "
        f"decoupled: the shipped syncer defaults with quorum K = {cfg['decoupled_quorum']}; diloco and dp: quorum = "
        f"all {cfg['learners']} learners, no grace, contributions beyond the norm bound clipped rather than refused "
        f"(a refusal would stall their barrier for good). {_settings_text(cfg, result['runs'])} Seeds {', '.join(map(str, seeds))}: for each, every mode runs once without faults "
        f"and once under that seed's failure schedule. The step pacing is a sleep after each inner step that "
        f"stands for an accelerator's step time: without it, every learner process competes for this machine's "
        f"cores, a restarted learner waits tens of seconds for CPU, and the benchmark measures CPU contention "
        f"rather than the protocols.\n\n"
        f"**Fault rate: {_fault_rate_text(cfg)}.**\n\n"
        f"{headline}\n\n"
        f"Each cell: mean over the seeds (min-max, population std). How each figure is computed:\n\n"
        f"- **goodput** (the paper's): {d['goodput']}. Model tokens merged = {d['model_tokens_merged']}. "
        f"Fault-free rate = {d['fault_free_rate']}; the same mode's rate because goodput measures what the faults "
        f"cost a system: its fault-free run scores its own tokens merged share. Wall time = {d['wall_s']}. Token "
        f"counts are whole-run totals (warm-up included; both runs of a mode process the same steps, so warm-up "
        f"tokens raise numerator and rate alike).\n"
        f"- **slowdown ratio** (secondary, not a goodput): "
        f"{d['slowdown_ratio']}. A run stopped at the wall-clock limit ({cfg.get('max_wall_s', 900.0):.0f} s from "
        f"launch) counts each unfinished learner until the stop, so its ratio is an upper bound (<=).\n"
        f"- **tokens merged share**: {d['tokens_merged_share']}.\n"
        f"- **contributors per merge / learners**: {d.get('contributors_per_merge', '-')}.\n"
        f"- **goodput vs decoupled's fault-free rate**: {d['goodput_vs_decoupled_rate']}.\n"
        f"- *learner wait*: {d['learner_wait_fraction']}. *Time to N merged tokens*: wall time from a run's first "
        f"merge until its merges held N model tokens, N = half of the smallest total any run of that seed merged.\n\n"
        f"**Schedule (fair by construction).** Faults are placed in training progress, not wall time: exponential "
        f"gaps of mean {cfg['mtbf_steps']:g} inner steps (on the step axis that every learner runs), each on a "
        f"seeded random learner, firing when that learner has run `at_step` inner steps (all its lives together). "
        f"Every mode of a seed gets the same faults, the same targets, at the same points of the training, "
        f"whatever its speed. Kill = SIGKILL, then a new learner process after the delay (it rejoins and runs the "
        f"steps its earlier lives did not report); stop = SIGSTOP, then SIGCONT (a hung learner).\n\n"
        f"## Per seed\n\n{per_seed}\n\n"
        + results_lib.provenance_markdown(result["provenance"])
    )


def plot(result: dict, path: pathlib.Path) -> None:
    """goodput.png: goodput and slowdown ratio per mode (mean over the seeds, min-max bars)."""
    from ddiloco import extras

    plt = extras.pyplot()  # the plots extra, Agg backend

    modes = list(result["modes"])
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(modes))
    for offset, key, label in ((-0.2, "goodput", "goodput"), (0.2, "slowdown_ratio", "slowdown ratio")):
        s = [result["modes"][m][key] for m in modes]
        means = [100 * (v["mean"] or 0.0) for v in s]
        lo = [m - 100 * (v["min"] if v["min"] is not None else 0.0) for m, v in zip(means, s)]
        hi = [100 * (v["max"] if v["max"] is not None else 0.0) - m for m, v in zip(means, s)]
        ax.bar([x + offset for x in xs], means, 0.4, yerr=[lo, hi], capsize=4, label=label)
        for x, m in zip(xs, means):
            ax.text(x + offset, m + 1, f"{m:.1f}", ha="center", fontsize=8)
    ax.axhline(88, ls="--", c="k", lw=0.8)
    ax.axhline(50, ls=":", c="k", lw=0.8)
    ax.set_xticks(list(xs), modes)
    ax.set_ylim(0, 110)
    ax.set_ylabel("%")
    ax.set_title(f"seeds {', '.join(map(str, result['seeds']))}, MTBF {result['config']['mtbf_steps']:g} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
