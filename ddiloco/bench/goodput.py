"""`ddiloco bench goodput`: goodput under seeded failure schedules, Decoupled DiLoCo vs its baselines.

Every mode trains the same model on the same data with the same seed and steps per learner,
through the real services on 127.0.0.1 (the chaos harness, ddiloco/chaos/harness.py), twice: once
without faults, once under the *same* seeded failure schedule. Only the syncer's configuration
differs:

  * decoupled: Decoupled DiLoCo (staggered fragments, quorum K, adaptive grace window); learners
    never wait for one another;
  * diloco: synchronous DiLoCo (`--sync-mode diloco`, quorum = every learner): learners wait for
    each merge, so a dead or hung learner stalls everyone until it is back;
  * dp: data-parallel through the syncer (`--sync-mode dp`, quorum = every learner): a barrier at
    every step;
  * diloco-job, dp-job: the same syncers, but a learner's kill takes the whole learner job down
    (every learner is killed and restarted after the kill's delay, the syncer keeps the global
    state): the paper's "DP, no elasticity" baseline, a synchronous SPMD job that is relaunched as
    a whole when one worker dies. In diloco and dp only the killed learner restarts and rejoins
    while the others wait at the barrier: a more forgiving baseline than the paper's.

The default invocation runs decoupled, diloco-job and dp-job (the paper's comparison); --modes
adds diloco and dp. A -job mode's fault-free run is its base mode's (without faults the two are
the same run), so it is run once per seed and shared.

With `--seeds 0,1,2` every mode runs (fault-free, then faulty) for each seed: the seed sets the
failure schedule, the data order and the initial model. The report gives each figure per run and,
per mode, its mean and spread (min-max, population std) over the seeds.

The failure schedule is placed in training progress, not in wall time (`schedule.step_loop`):
SIGKILL (restart after restart_after_s) and SIGSTOP/SIGCONT (a hang of duration_s) of learners,
each at a learner's own inner step (`at_step`), with exponential gaps of mean --mtbf-steps on
the step axis. Every mode therefore gets the same faults, the same count, the same targets at
the same points of its training, however long it runs (a wall-time schedule hands more faults
to the slower modes). The rate (--mtbf-steps) is a flag fixed before running and the same for
every seed and mode; the report states it.

Figures per run (see DEFINITIONS, written into goodput.json and goodput.md next to the numbers):
  * goodput, as the paper means it (arXiv 2604.21428: 88 % for Decoupled DiLoCo vs 27 % for
    data-parallel under heavy failures): useful work / allocated capacity =
        tokens merged into the global model
        / (learners x fault-free per-learner token rate x wall time of the faulty run),
    with
      - tokens merged into the global model = TrainingState.tokens_merged / num_fragments at the
        end of the faulty run. tokens_merged sums the tokens of every merged contribution, and a
        contribution to one fragment carries the tokens of the inner steps it holds, so each inner
        step's tokens are counted once per fragment: dividing by num_fragments (dp: 1) gives model
        tokens, i.e. tokens whose update reached every fragment of the global model;
      - fault-free per-learner token rate = TrainingState.tokens_processed of the *same mode's*
        fault-free run / (learners x that run's wall time). The same mode's: a system's allocated
        capacity is what its learners process per second when nothing fails, so the fault-free run
        scores its own tokens-merged share (~100 %) and the goodput measures what the faults cost.
        One machine-wide rate (decoupled's, whose learners never wait) would also charge the
        synchronous modes their fault-free barrier waits, a communication cost of this CPU host,
        not a failure loss; that reading is in the JSON as `goodput_vs_decoupled_rate`;
      - wall time = from the schedule's start (every learner has contributed, `Result.t0`) until
        the last learner finished (its remaining progress merged, process exited), or until the
        run was stopped at --max-wall-s. Token counts are whole-run totals (warm-up included):
        both runs of a mode process the same steps, so warm-up tokens raise numerator and rate
        alike.
  * slowdown ratio (the figure this benchmark called "goodput (time)" before): sum over learners
    of the fault-free time to finish / the same sum under the faults, each learner counted from
    the schedule's start until it has run its steps (dead, hung and waiting time included);
  * tokens merged share: tokens_merged / (num_fragments x tokens_processed) of a run, faulty and
    fault-free: the share of processed work that reached the global model;
  * learner wait: time the learners spent blocked on the syncer / (blocked + computing);
  * final held-out loss, faulty vs fault-free, and the invariants I1-I4 of the faulty run.

Results: `goodput.json` and `goodput.md` under --out (bench/results by default), with provenance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys

from ddiloco.bench import results as results_lib
from ddiloco.bench.goodput_report import (  # noqa: F401 (_slowdown_cell: re-exported for tests)
    DEFINITIONS,
    _fault_rate_text,
    _slowdown_cell,
    _spread_cell,
    plot,
    render_markdown,
)

MODES = ("decoupled", "diloco", "dp", "diloco-job", "dp-job")
DEFAULT_MODES = ("decoupled", "diloco-job", "dp-job")
JOB_SUFFIX = "-job"  # a learner's kill restarts every learner (Scenario.kill_scope "job")


def base_mode(mode: str) -> str:
    """The syncer's sync mode of a benchmark mode: dp-job -> dp."""
    return mode.removesuffix(JOB_SUFFIX)


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    # The committed run's shape (bench/results/goodput.md). 16 learners: goodput separates the
    # modes only when one learner's downtime is small for it but large summed over the fleet
    # (a synchronous mode stalls whenever any learner is down). 0.2 s of pacing per step stands
    # for an accelerator's step time and keeps 16 processes on 2 cores from measuring CPU
    # contention instead of the protocols.
    learners: int = 16
    steps: int = 300
    step_delay_s: float = 0.2
    num_fragments: int = 4
    sync_period_steps: int = 4
    decoupled_quorum: int = 1
    # Mean gap between faults on the fleet's step axis: one fault per 8.5 inner steps of training
    # progress, the committed run's rate, fixed before it ran from the costs per fault measured at
    # MTBF 14 and 5 (bench/results/rounds.md), not tuned on results.
    mtbf_steps: float = 8.5
    # No fault before this step: the schedule starts once every learner contributed, and learners
    # that started first are a few dozen steps ahead by then (an earlier fault would fire late).
    start_step: int = 60
    max_fault_s: float = 4.0  # restart delays and hang durations are drawn from [0.5 or 1, this]
    seed: int = 1
    # A run still training after this long is stopped; its slowdown ratio is then an upper bound
    # (see learner_time). The synchronous modes under a heavy schedule take 2-3x their fault-free time.
    max_wall_s: float = 2400.0
    # How a run ends. budget (the paper's setting: a fleet trains to a token budget): the syncer's
    # --token-budget = learners x steps x batch_size x seq_len; each learner trains until the
    # syncer says the fleet has processed it (at most BUDGET_STEP_CAP x steps of its own), so a
    # learner set back by faults does not hold the run's end while the others idle. steps: each
    # learner runs exactly `steps` (the earlier design: the run lasts as long as its most-faulted
    # learner, and every other learner's idle wait is charged as lost capacity).
    run_end: str = "budget"
    batch_size: int = 16  # the learners' batch, passed explicitly: the budget is computed from it
    # The syncer's liveness timeout and grace cap for every mode. None: no flag, the syncer's shipped
    # defaults (what a deployment runs; the paper's 'no elasticity' baselines for faults shorter than
    # the timeout). A value is the chaos harness's shortened setting (3 s, 2 s in earlier runs).
    liveness_timeout_s: float | None = None
    max_grace_s: float | None = None


RUN_ENDS = ("budget", "steps")
BUDGET_STEP_CAP = 2  # budget runs: a learner's own limit, x steps (never the binding one in practice)


def token_budget(cfg: GoodputConfig) -> int:
    """The fleet's token budget of a budget run: learners x steps x tokens per inner step."""
    from ddiloco import models
    from ddiloco.chaos.harness import Scenario

    seq_len = models.get_model("transformer", json.loads(Scenario().model_config)).seq_len
    return cfg.learners * cfg.steps * cfg.batch_size * seq_len


def mode_scenario(cfg: GoodputConfig, mode: str):
    """The chaos Scenario of one mode (the syncer flags are all that differs)."""
    from ddiloco.chaos.harness import Scenario

    sync_mode = base_mode(mode)
    quorum = cfg.decoupled_quorum if sync_mode == "decoupled" else cfg.learners
    # Synchronous modes: once one learner finished, no barrier can complete again, so a learner
    # still running is stopped after a few seconds. It can only be one whose restart was handed a
    # few steps too many (the harness counts a killed life's steps from its last progress report),
    # and the default 90 s wait at its barrier would be charged to the mode as lost time.
    # Decoupled learners never wait: a restarted one finishing late is real lost time.
    finish_grace_s = 90.0 if sync_mode == "decoupled" else 5.0
    # Every mode runs the shipped syncer defaults of its sync mode: what ships is what is measured
    # (issue 24). The diloco preset clips contributions beyond the norm bound instead of refusing
    # them (with a quorum of every learner one refusal stalls the barrier for good), and dp has no
    # norm bound (services/syncer/config.py apply_sync_mode).
    args = ("--sync-mode", sync_mode)
    steps = cfg.steps
    if cfg.run_end == "budget":
        args = (*args, "--token-budget", str(token_budget(cfg)))
        steps = BUDGET_STEP_CAP * cfg.steps
    return Scenario(name=f"goodput-{mode}", seed=cfg.seed, learners=cfg.learners, min_quorum=quorum, steps=steps,
                    step_delay_s=cfg.step_delay_s, num_fragments=cfg.num_fragments,
                    sync_period_steps=cfg.sync_period_steps, finish_grace_s=finish_grace_s,
                    syncer_args=args, learner_args=("--batch-size", str(cfg.batch_size)), max_wall_s=cfg.max_wall_s,
                    liveness_timeout_s=cfg.liveness_timeout_s, max_grace_s=cfg.max_grace_s,
                    kill_scope="job" if mode.endswith(JOB_SUFFIX) else "learner")


def failure_schedule(cfg: GoodputConfig):
    """One seeded schedule, in training progress, for every mode: a function of the config only."""
    from ddiloco.chaos import schedule as schedule_lib

    return schedule_lib.step_loop(seed=cfg.seed, steps=cfg.steps, mtbf_steps=cfg.mtbf_steps, learners=cfg.learners,
                                  mix={"kill": 1.0, "stop": 1.0}, max_fault_s=cfg.max_fault_s,
                                  start_step=cfg.start_step)


def learner_time(result) -> tuple[float | None, bool]:
    """(summed learner time from the schedule's start to each learner's finish, whether all finished).

    A run stopped at max_wall_s counts each unfinished learner until the stop: a lower bound of its
    allocated time, so fault-free time / this sum is an upper bound of the run's slowdown ratio.
    """
    if not result.t0:
        return None, False
    unfinished = result.scenario.learners - len(result.learner_finished_at)
    if unfinished and not result.stopped_at:
        return None, False
    total = sum(t - result.t0 for t in result.learner_finished_at.values())
    return total + unfinished * (result.stopped_at - result.t0), unfinished == 0


def run_wall_s(result) -> float | None:
    """Wall time of a run: the schedule's start to the last learner's finish (or the stop)."""
    end = result.training_end or result.stopped_at
    return end - result.t0 if result.t0 and end > result.t0 else None


def token_counts(result) -> dict:
    """The syncer's final counters of a run: tokens_processed (every life of every learner),
    tokens_merged (fragment-tokens of merged contributions) and num_fragments (dp: 1)."""
    state = result.final_state or {}
    starts = [r for r in result.syncer_history if r.get("event") == "start"]
    fragments = (len(starts[-1]["fragments"]) if starts and starts[-1].get("fragments")
                 else len(state.get("fragments") or []) or result.scenario.num_fragments)
    # MessageToDict renders uint64 as strings and leaves zeros out.
    return {"tokens_processed": int(state.get("tokens_processed", 0)),
            "tokens_merged": int(state.get("tokens_merged", 0)), "num_fragments": fragments}


def goodput_figures(*, learners: int, fragments: int, tokens_merged: int, wall_s: float | None,
                    baseline_tokens_processed: int, baseline_wall_s: float | None) -> dict:
    """The paper's goodput of one run, with the quantities it is made of.

    model tokens merged = tokens_merged / fragments;
    fault-free rate = baseline_tokens_processed / (learners x baseline_wall_s)  (tokens/s per learner);
    goodput = model tokens merged / (learners x fault-free rate x wall_s).
    """
    model_tokens = tokens_merged / fragments if fragments else None
    rate = (baseline_tokens_processed / (learners * baseline_wall_s)
            if baseline_tokens_processed and baseline_wall_s and learners else None)
    capacity = learners * rate * wall_s if rate and wall_s else None
    return {"model_tokens_merged": model_tokens, "fault_free_rate": rate, "capacity_tokens": capacity,
            "goodput": model_tokens / capacity if capacity and model_tokens is not None else None}


def merged_share(counts: dict) -> float | None:
    """tokens_merged / (num_fragments x tokens_processed)."""
    denom = counts["num_fragments"] * counts["tokens_processed"]
    return counts["tokens_merged"] / denom if denom else None


def contributors_per_merge(result) -> float | None:
    """Mean learners per merge (syncer history) / the run's learners."""
    merges = [r for r in result.syncer_history if r.get("event") == "merged"]
    if not merges or not result.scenario.learners:
        return None
    return statistics.fmean(len({c[0] for c in r.get("contributors", [])}) for r in merges) / result.scenario.learners


def syncer_settings(result) -> dict:
    """The liveness timeout and grace cap the run's syncer recorded at its first start ({} if not recorded)."""
    start = next((r for r in result.syncer_history if r.get("event") == "start"), {})
    return {k: start[k] for k in ("liveness_timeout_s", "max_grace_s") if k in start}


def _summary(result, baseline) -> dict:
    wait = sum((s or {}).get("wait_s", 0.0) for s in result.summaries.values())
    compute = sum((s or {}).get("compute_s", 0.0) for s in result.summaries.values())

    def train_s(r) -> float | None:
        return r.training_end - r.t0 if r.training_end and r.t0 else None

    faulty_ls, finished = learner_time(result)
    healthy_ls, healthy_finished = learner_time(baseline)
    healthy_ls = healthy_ls if healthy_finished else None
    ratio = healthy_ls / faulty_ls if faulty_ls and healthy_ls else None
    stopped = bool(result.stopped_at and not result.training_end)
    counts, base_counts = token_counts(result), token_counts(baseline)
    wall_s, base_wall_s = run_wall_s(result), run_wall_s(baseline)
    learners = result.scenario.learners
    figures = goodput_figures(learners=learners, fragments=counts["num_fragments"],
                              tokens_merged=counts["tokens_merged"], wall_s=wall_s,
                              baseline_tokens_processed=base_counts["tokens_processed"], baseline_wall_s=base_wall_s)
    base_figures = goodput_figures(learners=learners, fragments=base_counts["num_fragments"],
                                   tokens_merged=base_counts["tokens_merged"], wall_s=base_wall_s,
                                   baseline_tokens_processed=base_counts["tokens_processed"],
                                   baseline_wall_s=base_wall_s)
    return {
        "ok": result.ok, "violations": result.violations()[:10], "report": result.report_line,
        "baseline_report": baseline.report_line,
        "faults_injected": len(result.faults), "not_injected": len(result.not_injected),
        "faults": [f"{f.kind} {f.target}" for f in result.faults],
        # Stopped at --max-wall-s with learners still training (the harness set no training end).
        "finished": finished, "stopped": stopped,
        "stopped_after_s": result.stopped_at - result.t0 if stopped and result.t0 else None,
        # The paper's goodput and what it is made of.
        "goodput": figures["goodput"], "model_tokens_merged": figures["model_tokens_merged"],
        "fault_free_rate": figures["fault_free_rate"], "capacity_tokens": figures["capacity_tokens"],
        "wall_s": wall_s, "baseline_wall_s": base_wall_s,
        "tokens_processed": counts["tokens_processed"], "tokens_merged": counts["tokens_merged"],
        "num_fragments": counts["num_fragments"],
        "baseline_tokens_processed": base_counts["tokens_processed"],
        "baseline_tokens_merged": base_counts["tokens_merged"],
        "baseline_goodput": base_figures["goodput"],
        "tokens_merged_share": merged_share(counts), "baseline_tokens_merged_share": merged_share(base_counts),
        # Secondary: the slowdown ratio (summed learner time to finish, fault-free / faulty).
        "slowdown_ratio": ratio if finished else None,
        # Stopped at max_wall_s with learners still training: the slowdown ratio is at most this.
        "slowdown_ratio_at_most": ratio if not finished else None,
        "learner_s": faulty_ls if finished else None, "baseline_learner_s": healthy_ls,
        "training_s": train_s(result), "baseline_training_s": train_s(baseline),
        "learner_wait_fraction": wait / (wait + compute) if wait + compute else None,
        "contributors_per_merge": contributors_per_merge(result),
        "baseline_contributors_per_merge": contributors_per_merge(baseline),
        "loss": result.loss, "baseline_loss": baseline.loss,
        "recovery_s": sorted(result.recoveries),
        "syncer_settings": syncer_settings(result),
    }


def add_decoupled_rate(modes: dict) -> None:
    """goodput_vs_decoupled_rate: each mode's goodput with the decoupled fault-free rate as capacity."""
    ref = (modes.get("decoupled") or {}).get("fault_free_rate")
    for r in modes.values():
        cap = r["capacity_tokens"] * ref / r["fault_free_rate"] if ref and r.get("capacity_tokens") else None
        r["goodput_vs_decoupled_rate"] = (r["model_tokens_merged"] / cap
                                          if cap and r.get("model_tokens_merged") is not None else None)


def spread(values: list[float | None]) -> dict:
    """mean, min, max and population std of the known values (n: how many)."""
    known = [v for v in values if v is not None]
    if not known:
        return {"mean": None, "min": None, "max": None, "std": None, "n": 0, "values": list(values)}
    return {"mean": statistics.fmean(known), "min": min(known), "max": max(known),
            "std": statistics.pstdev(known), "n": len(known), "values": list(values)}


AGGREGATED = ("goodput", "goodput_vs_decoupled_rate", "slowdown_ratio", "tokens_merged_share",
              "baseline_tokens_merged_share", "baseline_goodput", "learner_wait_fraction", "faults_injected",
              "contributors_per_merge", "baseline_contributors_per_merge")


def aggregate(runs: list[dict]) -> dict:
    """Per mode, over the seeds' runs: spread() of each figure, and whether every run passed."""
    modes: dict[str, dict] = {}
    for run in runs:
        for mode, r in run["modes"].items():
            modes.setdefault(mode, {"seeds": [], "runs": []})
            modes[mode]["seeds"].append(run["seed"])
            modes[mode]["runs"].append(r)
    out = {}
    for mode, m in modes.items():
        agg = {k: spread([r.get(k) for r in m["runs"]]) for k in AGGREGATED}
        # A stopped run has only an upper bound of its slowdown ratio: kept apart.
        agg["slowdown_ratio_at_most"] = spread([r.get("slowdown_ratio_at_most") for r in m["runs"]])
        out[mode] = {"seeds": m["seeds"], "ok": all(r["ok"] for r in m["runs"]),
                     "stopped": sum(1 for r in m["runs"] if r.get("stopped")), **agg}
    return out


def merged_token_curve(history_path: pathlib.Path, fragments: int) -> list[tuple[float, float]]:
    """(seconds since the run's first merge, tokens merged so far) after each merge, read from a
    syncer history file. A fragment's merge adds its contributors' tokens / P, so a round that
    merged every fragment once counts its tokens once (model-level tokens)."""
    curve: list[tuple[float, float]] = []
    try:
        lines = history_path.read_text().splitlines()
    except FileNotFoundError:
        return curve
    merges = sorted((rec["t"], rec) for rec in map(json.loads, filter(None, lines)) if rec.get("event") == "merged")
    total = 0.0
    for t, rec in merges:
        total += sum(c[3] for c in rec.get("contributors", [])) / fragments
        curve.append((t - merges[0][0], total))
    return curve


def time_to_tokens(curve: list[tuple[float, float]], tokens: float) -> float | None:
    """The first time on `curve` at which `tokens` were merged (None: never)."""
    return next((t for t, total in curve if total >= tokens), None)


def add_token_milestones(out: dict, workdir: pathlib.Path) -> None:
    """Adds the wall time each run took to merge a fixed number of tokens: half of the smallest
    total that any run (any mode, with or without faults) merged, so that every run reaches it.
    `out` is one seed's run ({"modes": ...}); `fragments` is the config's (dp's runs: see below)."""
    fragments = out["config"]["num_fragments"]
    curves = {(mode, run): merged_token_curve(workdir / name / "history" / "syncer.jsonl",
                                              out["modes"][mode].get("num_fragments") or fragments)
              for mode in out["modes"] for run, name in (("faulty", mode), ("fault-free", f"{base_mode(mode)}-baseline"))}
    finals = [curve[-1][1] for curve in curves.values() if curve]
    if not finals:
        return
    target = 0.5 * min(finals)
    out["tokens_target"] = target
    for mode, r in out["modes"].items():
        r["time_to_tokens_s"] = time_to_tokens(curves[(mode, "faulty")], target)
        r["baseline_time_to_tokens_s"] = time_to_tokens(curves[(mode, "fault-free")], target)


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2] (order kept, duplicates refused)."""
    seeds = [int(s) for s in text.split(",") if s.strip()]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: a comma-separated list of distinct integers, not {text!r}")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GoodputConfig()
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated subset of {','.join(MODES)} (-job: a learner's kill restarts every "
                             "learner, the paper's 'DP, no elasticity')")
    parser.add_argument("--learners", type=int, default=d.learners)
    parser.add_argument("--steps", type=int, default=d.steps,
                        help="inner steps per learner (budget runs: the fleet's budget is learners x this)")
    parser.add_argument("--run-end", choices=RUN_ENDS, default=d.run_end,
                        help="budget: the run ends when the fleet processed learners x steps x batch tokens (syncer "
                             "--token-budget), each learner trains until then; steps: each learner runs exactly "
                             "--steps (the run lasts as long as its most-faulted learner)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="the learners' batch (sequences)")
    parser.add_argument("--step-delay-s", type=float, default=d.step_delay_s,
                        help="sleep after each inner step, standing for an accelerator's step time")
    parser.add_argument("--mtbf-steps", type=float, default=d.mtbf_steps,
                        help="the fault rate, fixed before running: mean gap between learner faults, in inner "
                             "steps of training progress (fleet-wide); the same for every seed and mode")
    parser.add_argument("--max-fault-s", type=float, default=d.max_fault_s,
                        help="upper bound of a kill's restart delay and a hang's duration")
    parser.add_argument("--start-step", type=int, default=d.start_step, help="no fault before this inner step")
    parser.add_argument("--quorum", type=int, default=d.decoupled_quorum, help="decoupled mode's K")
    parser.add_argument("--liveness-timeout-s", type=float, default=d.liveness_timeout_s,
                        help="every mode's syncer liveness timeout (default: the syncer's shipped default)")
    parser.add_argument("--max-grace-s", type=float, default=d.max_grace_s,
                        help="every mode's syncer grace cap (default: the syncer's shipped default)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds, e.g. 0,1,2: every mode runs (fault-free and faulty) for each; "
                             "the report gives mean and spread per mode (default: --seed)")
    parser.add_argument("--seed", type=int, default=d.seed, help="the one seed when --seeds is not given")
    parser.add_argument("--max-wall-s", type=float, default=d.max_wall_s,
                        help="stop a run still training after this long (its slowdown ratio is then an upper bound)")
    parser.add_argument("--out", default=str(results_lib.DEFAULT_OUT_DIR))
    parser.add_argument("--workdir", default="runs/bench-goodput",
                        help="the runs' processes, logs and histories (one seed-<n> folder per seed)")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: rewrite the report from --out's goodput.json and --workdir's histories")


def run(args: argparse.Namespace) -> int:
    from ddiloco.chaos import harness

    if args.render_only:
        return _render_only(pathlib.Path(args.out), pathlib.Path(args.workdir))

    try:
        seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    cfg = GoodputConfig(learners=args.learners, steps=args.steps, step_delay_s=args.step_delay_s,
                        mtbf_steps=args.mtbf_steps, max_fault_s=args.max_fault_s, start_step=args.start_step,
                        decoupled_quorum=args.quorum, seed=seeds[0], max_wall_s=args.max_wall_s,
                        run_end=args.run_end, batch_size=args.batch_size,
                        liveness_timeout_s=args.liveness_timeout_s, max_grace_s=args.max_grace_s)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        print(f"unknown modes {sorted(unknown)}; choose from {MODES}", file=sys.stderr)
        return 2
    prov = results_lib.provenance()
    workdir = pathlib.Path(args.workdir)
    print(f"fault rate fixed before running: MTBF {cfg.mtbf_steps:g} inner steps; seeds {seeds}; modes {modes}",
          file=sys.stderr, flush=True)
    out = {"config": dataclasses.asdict(cfg), "seeds": seeds,
           "fault_rate": {"mtbf_steps": cfg.mtbf_steps, "fixed_before_running": True,
                          "text": _fault_rate_text(dataclasses.asdict(cfg))},
           "definitions": DEFINITIONS, "provenance": prov, "runs": [], "modes": {}}
    for seed in seeds:
        seed_cfg = dataclasses.replace(cfg, seed=seed)
        events = failure_schedule(seed_cfg)
        run_out = {"seed": seed, "schedule": [e.to_json() for e in events], "modes": {}}
        seed_dir = workdir / f"seed-{seed}"
        baselines = {}  # base mode -> its fault-free run (a -job mode without faults is its base mode)
        for mode in modes:
            scenario = mode_scenario(seed_cfg, mode)
            if base_mode(mode) not in baselines:
                print(f"[seed {seed}] [{base_mode(mode)}] fault-free run", file=sys.stderr, flush=True)
                baselines[base_mode(mode)] = harness.run_scenario(
                    mode_scenario(seed_cfg, base_mode(mode)).fault_free(), [], seed_dir / f"{base_mode(mode)}-baseline",
                    jax_cache_dir=workdir / ".jax-cache", on_event=lambda line: None)
                print(baselines[base_mode(mode)].report_line, flush=True)
            baseline = baselines[base_mode(mode)]
            print(f"[seed {seed}] [{mode}] under the failure schedule ({len(events)} faults planned)",
                  file=sys.stderr, flush=True)
            result = harness.run_scenario(scenario, events, seed_dir / mode, baseline_loss=None,
                                          jax_cache_dir=workdir / ".jax-cache", on_event=lambda line: None)
            print(result.report_line, flush=True)
            run_out["modes"][mode] = _summary(result, baseline)
        add_decoupled_rate(run_out["modes"])
        out["runs"].append(run_out)
        if seed != seeds[-1]:  # the seeds so far, so a run cut short still leaves its finished seeds
            _write(out, pathlib.Path(args.out), workdir)
    return _write(out, pathlib.Path(args.out), workdir)


def _render_only(out_dir: pathlib.Path, workdir: pathlib.Path) -> int:
    try:
        out = json.loads((out_dir / "goodput.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"--render-only needs a goodput.json from an earlier run in {out_dir}: {exc}", file=sys.stderr)
        return 2
    if "runs" not in out:
        print(f"{out_dir / 'goodput.json'} is from before --seeds and the paper's goodput (no 'runs'): re-run the "
              "benchmark", file=sys.stderr)
        return 2
    return _write(out, out_dir, workdir)


def _write(out: dict, out_dir: pathlib.Path, workdir: pathlib.Path) -> int:
    for run in out["runs"]:
        run_view = {"config": out["config"], "modes": run["modes"]}
        add_token_milestones(run_view, workdir / f"seed-{run['seed']}")
        if "tokens_target" in run_view:
            run["tokens_target"] = run_view["tokens_target"]
    out["modes"] = aggregate(out["runs"])
    json_path, md_path = results_lib.write_result(out_dir, "goodput", out, render_markdown(out))
    plot(out, out_dir / "goodput.png")
    print(f"wrote {json_path}, {md_path} and goodput.png")
    for mode, a in out["modes"].items():
        print(f"{mode}: goodput {_spread_cell(a['goodput'])}, slowdown ratio {_spread_cell(a['slowdown_ratio'])}, "
              f"tokens merged share {_spread_cell(a['tokens_merged_share'])}")
    return 0 if all(a["ok"] for a in out["modes"].values()) else 1
