"""`ddiloco bench goodput`: goodput under one seeded failure schedule, Decoupled DiLoCo vs its baselines.

Every mode trains the same model on the same data with the same seed and steps per learner,
through the real services on 127.0.0.1 (the chaos harness, ddiloco/chaos/harness.py), twice: once
without faults, once under the *same* seeded failure schedule. Only the syncer's configuration
differs:

  * decoupled: Decoupled DiLoCo (staggered fragments, quorum K, adaptive grace window); learners
    never wait for one another;
  * diloco: synchronous DiLoCo (`--sync-mode diloco`, quorum = every learner): learners wait for
    each merge, so a dead or hung learner stalls everyone until it is back;
  * dp: data-parallel through the syncer (`--sync-mode dp`, quorum = every learner): a barrier at
    every step.

The failure schedule is placed in training progress, not in wall time (`schedule.step_loop`):
SIGKILL (restart after restart_after_s) and SIGSTOP/SIGCONT (a hang of duration_s) of learners,
each at a learner's own inner step (`at_step`), with exponential gaps of mean --mtbf-steps on
the step axis. Every mode therefore gets the same faults, the same count, the same targets at
the same points of its training, however long it runs (a wall-time schedule hands more faults
to the slower modes).

Figures per mode (the paper's headline is the first: 88 % for Decoupled DiLoCo vs 27 % for
data-parallel under heavy failures, arXiv 2604.21428):
  * goodput (time), the paper's definition: the share of allocated learner time that ends up in
    the global model. Each learner identity is allocated from the start of the schedule until it
    has run its steps (dead, hung and waiting time included); the useful part is what the same
    steps take without faults. So: sum over learners of the fault-free time to finish / the same
    sum under the faults (a learner that waits for a dead peer loses time; one that trains on
    does not);
  * tokens merged: tokens in surviving merges / (P x tokens the learners processed), with and
    without faults. Not a goodput: with overwrite-on-receipt (alpha = 0) a fragment's local steps
    that no merge pulled in are overwritten by the next broadcast, so decoupled with a small
    quorum K sits well below 100 % even fault-free (an algorithmic token efficiency, not a
    fault loss); the synchronous modes merge every learner every round (100 %);
  * learner wait: time the learners spent blocked on the syncer / (blocked + computing);
  * final held-out loss, faulty vs fault-free, and the invariants I1-I4 of the faulty run.

Results: `goodput.json` and `goodput.md` under --out (bench/results by default), with provenance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from ddiloco.bench import results as results_lib

MODES = ("decoupled", "diloco", "dp")


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    learners: int = 6
    steps: int = 300
    step_delay_s: float = 0.03
    num_fragments: int = 4
    sync_period_steps: int = 4
    decoupled_quorum: int = 1
    mtbf_steps: float = 90.0  # mean gap between faults, in inner steps of the targeted learner
    # No fault before this step: the schedule starts once every learner contributed, and learners
    # that started first are a few dozen steps ahead by then (an earlier fault would fire late).
    start_step: int = 60
    max_fault_s: float = 4.0  # restart delays and hang durations are drawn from [0.5 or 1, this]
    seed: int = 1
    # A run still training after this long is stopped; its goodput is then an upper bound (see
    # learner_time). The synchronous modes under a heavy schedule take 2-3x their fault-free time.
    max_wall_s: float = 2400.0


def mode_scenario(cfg: GoodputConfig, mode: str):
    """The chaos Scenario of one mode (the syncer flags are all that differs)."""
    from ddiloco.chaos import scenarios
    from ddiloco.chaos.harness import Scenario

    quorum = cfg.decoupled_quorum if mode == "decoupled" else cfg.learners
    # Synchronous modes: once one learner finished, no barrier can complete again, so a learner
    # still running is stopped after a few seconds. It can only be one whose restart was handed a
    # few steps too many (the harness counts a killed life's steps from its last progress report),
    # and the default 90 s wait at its barrier would be charged to the mode as lost time.
    # Decoupled learners never wait: a restarted one finishing late is real lost time.
    finish_grace_s = 90.0 if mode == "decoupled" else 5.0
    return Scenario(name=f"goodput-{mode}", seed=cfg.seed, learners=cfg.learners, min_quorum=quorum, steps=cfg.steps,
                    step_delay_s=cfg.step_delay_s, num_fragments=cfg.num_fragments,
                    sync_period_steps=cfg.sync_period_steps, finish_grace_s=finish_grace_s,
                    syncer_args=(*scenarios.CHAOS_SYNCER_ARGS, "--sync-mode", mode), max_wall_s=cfg.max_wall_s)


def failure_schedule(cfg: GoodputConfig):
    """One seeded schedule, in training progress, for every mode: a function of the config only."""
    from ddiloco.chaos import schedule as schedule_lib

    return schedule_lib.step_loop(seed=cfg.seed, steps=cfg.steps, mtbf_steps=cfg.mtbf_steps, learners=cfg.learners,
                                  mix={"kill": 1.0, "stop": 1.0}, max_fault_s=cfg.max_fault_s,
                                  start_step=cfg.start_step)


def learner_time(result) -> tuple[float | None, bool]:
    """(summed learner time from the schedule's start to each learner's finish, whether all finished).

    A run stopped at max_wall_s counts each unfinished learner until the stop: a lower bound of its
    allocated time, so fault-free time / this sum is an upper bound of the run's goodput.
    """
    if not result.t0:
        return None, False
    unfinished = result.scenario.learners - len(result.learner_finished_at)
    if unfinished and not result.stopped_at:
        return None, False
    total = sum(t - result.t0 for t in result.learner_finished_at.values())
    return total + unfinished * (result.stopped_at - result.t0), unfinished == 0


def _summary(result, baseline) -> dict:
    wait = sum((s or {}).get("wait_s", 0.0) for s in result.summaries.values())
    compute = sum((s or {}).get("compute_s", 0.0) for s in result.summaries.values())

    def train_s(r) -> float | None:
        return r.training_end - r.t0 if r.training_end and r.t0 else None

    faulty_ls, finished = learner_time(result)
    healthy_ls, healthy_finished = learner_time(baseline)
    healthy_ls = healthy_ls if healthy_finished else None
    ratio = healthy_ls / faulty_ls if faulty_ls and healthy_ls else None
    return {
        "ok": result.ok, "violations": result.violations()[:10], "report": result.report_line,
        "baseline_report": baseline.report_line,
        "faults_injected": len(result.faults), "not_injected": len(result.not_injected),
        "faults": [f"{f.kind} {f.target}" for f in result.faults],
        "training_s": train_s(result), "baseline_training_s": train_s(baseline),
        "learner_s": faulty_ls if finished else None, "baseline_learner_s": healthy_ls,
        "goodput_time": ratio if finished else None,
        # Stopped at max_wall_s with learners still training: goodput is at most this.
        "goodput_time_at_most": ratio if not finished else None,
        "stopped_after_s": None if finished or not result.stopped_at else result.stopped_at - result.t0,
        "goodput_tokens": result.goodput, "baseline_goodput_tokens": baseline.goodput,
        "learner_wait_fraction": wait / (wait + compute) if wait + compute else None,
        "loss": result.loss, "baseline_loss": baseline.loss,
        "recovery_s": sorted(result.recoveries),
    }


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
    total that any run (any mode, with or without faults) merged, so that every run reaches it."""
    fragments = out["config"]["num_fragments"]
    curves = {(mode, run): merged_token_curve(workdir / name / "history" / "syncer.jsonl", fragments)
              for mode in out["modes"] for run, name in (("faulty", mode), ("fault-free", f"{mode}-baseline"))}
    finals = [curve[-1][1] for curve in curves.values() if curve]
    if not finals:
        return
    target = 0.5 * min(finals)
    out["tokens_target"] = target
    for mode, r in out["modes"].items():
        r["time_to_tokens_s"] = time_to_tokens(curves[(mode, "faulty")], target)
        r["baseline_time_to_tokens_s"] = time_to_tokens(curves[(mode, "fault-free")], target)


def _seconds(faulty: float | None, fault_free: float | None) -> str:
    return f"{faulty:.0f} s ({fault_free:.0f} s)" if faulty is not None and fault_free is not None else "-"


def _pct(v: float | None) -> str:
    return f"{100 * v:.1f} %" if v is not None else "-"


def _goodput_cell(r: dict) -> str:
    if r.get("goodput_time") is not None:
        return f"**{_pct(r['goodput_time'])}**"
    if r.get("goodput_time_at_most") is not None:
        return f"**<= {_pct(r['goodput_time_at_most'])}** (stopped {r['stopped_after_s']:.0f} s into the schedule)"
    return "-"


def _goodput_value(r: dict) -> float:
    return r.get("goodput_time") or r.get("goodput_time_at_most") or 0.0


def render_markdown(result: dict) -> str:
    cfg = result["config"]
    rows = []
    for mode, r in result["modes"].items():
        loss = (f"{r['loss']:.3f} ({r['baseline_loss']:.3f})" if r["loss"] is not None and r["baseline_loss"] is not None
                else "-")
        lost = (f"{r['learner_s'] - r['baseline_learner_s']:.0f} s"
                if r.get("learner_s") and r.get("baseline_learner_s") else "-")
        rows.append([mode, f"{r['faults_injected']} (+{r['not_injected']} not)", _goodput_cell(r), lost,
                     f"{_pct(r['goodput_tokens'])} ({_pct(r['baseline_goodput_tokens'])})",
                     _pct(r["learner_wait_fraction"]),
                     f"{r['training_s']:.0f} s ({r['baseline_training_s']:.0f} s)" if r["training_s"] else "-",
                     _seconds(r.get("time_to_tokens_s"), r.get("baseline_time_to_tokens_s")),
                     loss, "PASS" if r["ok"] else "FAIL"])
    target = result.get("tokens_target")
    table = results_lib.markdown_table(
        ["mode", "faults", "goodput (time)", "learner time lost", "tokens merged (fault-free)", "learner wait",
         "training (fault-free)", f"time to {target:,.0f} merged tokens (fault-free)" if target else "time to merged tokens",
         "final loss (fault-free)", "invariants"], rows)
    schedule = "\n".join(
        f"| {e['at_step']} | {e['target']} | {e['kind']} | "
        + (f"restart after {e['params'].get('restart_after_s')} s" if e["kind"] == "kill"
           else f"SIGCONT after {e['params'].get('duration_s')} s") + " |"
        for e in result["schedule"])
    return (
        f"# Goodput under failures: decoupled vs synchronous DiLoCo vs data-parallel\n\n"
        f"{cfg['learners']} learners x {cfg['steps']} inner steps each (tiny transformer, step pacing "
        f"{cfg['step_delay_s']} s, {cfg['num_fragments']} fragments, H = {cfg['sync_period_steps']}), "
        f"decoupled quorum K = {cfg['decoupled_quorum']}; diloco and dp: quorum = all {cfg['learners']} "
        f"learners, no grace. Each mode runs once without faults and once under the same seeded failure "
        f"schedule (seed {cfg['seed']}). The step pacing is a sleep after each inner step that stands for "
        f"an accelerator's step time: without it, every learner process competes for this machine's "
        f"cores, a restarted learner waits tens of seconds for CPU, and the benchmark measures CPU "
        f"contention rather than the protocols.\n\n"
        f"**Schedule (fair by construction).** {len(result['schedule'])} learner faults placed in training "
        f"progress, not wall time: exponential gaps of mean {cfg['mtbf_steps']:g} inner steps (MTBF, on the "
        f"step axis that every learner runs), each on a seeded random learner, firing when that learner has run "
        f"`at_step` inner steps (all its lives together). Every mode gets the same faults, the same targets, at "
        f"the same points of the training, whatever its speed. Kill = SIGKILL, then a new learner process after "
        f"the delay (it rejoins and runs the steps its earlier lives did not report); stop = SIGSTOP, then "
        f"SIGCONT (a hung learner).\n\n"
        f"| at step | learner | fault | heal |\n|---|---|---|---|\n{schedule}\n\n"
        f"**Goodput (time)**, the paper's definition: the share of allocated learner time that ends up in the "
        f"global model. Each learner is allocated from the start of the schedule (every learner contributing) "
        f"until it has run its steps, dead, hung and waiting time included; the useful part is what the same steps "
        f"take without faults. Goodput = sum over learners of the fault-free time to finish / the same sum under "
        f"the faults. *Learner time lost* is the difference of the sums. **Tokens merged** = tokens in surviving "
        f"merges / (P x tokens processed), faulty (fault-free): not a goodput but a token efficiency; with "
        f"overwrite-on-receipt a fragment's local steps that no merge pulled in are overwritten by the next "
        f"broadcast, so decoupled with K = {cfg['decoupled_quorum']} sits below 100 % with or without faults, "
        f"while the synchronous modes merge every learner in every round. *Time to N merged tokens*: wall time "
        f"from a run's first merge until its merges held N tokens (a fragment's merge counts its contributors' "
        f"tokens / P), N = half of the smallest total any run merged, so that every run reaches it. A run still "
        f"training at the wall-clock limit ({cfg.get('max_wall_s', 900.0):.0f} s from launch) is stopped; each "
        f"unfinished learner is then counted until the stop, a lower bound of its allocated time, so its goodput "
        f"is shown as an upper bound (<=) and its invariants fail on the unfinished learners.\n\n"
        f"{table}\n\n"
        f"Report lines (faulty runs):\n\n" + "\n".join(f"- `{r['report']}`" for r in result["modes"].values())
        + "\n\n" + results_lib.provenance_markdown(result["provenance"])
    )


def plot(result: dict, path: pathlib.Path) -> None:
    """goodput.png: goodput (time) per mode, and the summed learner time with and without faults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    vals = [100 * _goodput_value(result["modes"][m]) for m in modes]
    ax1.bar(modes, vals, color=["tab:green", "tab:orange", "tab:red"][:len(modes)])
    for x, v in enumerate(vals):
        bound = result["modes"][modes[x]].get("goodput_time") is None and v
        ax1.text(x, v + 1, f"{'<= ' if bound else ''}{v:.1f} %", ha="center")
    ax1.axhline(90, ls="--", c="k", lw=0.8)
    ax1.axhline(50, ls=":", c="k", lw=0.8)
    ax1.set_ylim(0, 105)
    ax1.set_ylabel("goodput (time), %")
    ax1.set_title(f"{len(result['schedule'])} faults, MTBF {result['config']['mtbf_steps']:g} steps")
    xs = range(len(modes))
    ax2.bar([x - 0.2 for x in xs], [result["modes"][m].get("baseline_learner_s") or 0 for m in modes], 0.4,
            label="fault-free")
    ax2.bar([x + 0.2 for x in xs], [result["modes"][m].get("learner_s") or 0 for m in modes], 0.4, label="faults")
    ax2.set_xticks(list(xs), modes)
    ax2.set_ylabel("summed learner time to finish, s")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GoodputConfig()
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of decoupled,diloco,dp")
    parser.add_argument("--learners", type=int, default=d.learners)
    parser.add_argument("--steps", type=int, default=d.steps, help="inner steps per learner")
    parser.add_argument("--step-delay-s", type=float, default=d.step_delay_s,
                        help="sleep after each inner step, standing for an accelerator's step time")
    parser.add_argument("--mtbf-steps", type=float, default=d.mtbf_steps,
                        help="mean gap between learner faults, in inner steps")
    parser.add_argument("--max-fault-s", type=float, default=d.max_fault_s,
                        help="upper bound of a kill's restart delay and a hang's duration")
    parser.add_argument("--start-step", type=int, default=d.start_step, help="no fault before this inner step")
    parser.add_argument("--quorum", type=int, default=d.decoupled_quorum, help="decoupled mode's K")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--max-wall-s", type=float, default=d.max_wall_s,
                        help="stop a run still training after this long (its goodput is then an upper bound)")
    parser.add_argument("--out", default=str(results_lib.DEFAULT_OUT_DIR))
    parser.add_argument("--workdir", default="runs/bench-goodput", help="the runs' processes, logs and histories")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: rewrite the report from --out's goodput.json and --workdir's histories")


def run(args: argparse.Namespace) -> int:
    from ddiloco.chaos import harness

    if args.render_only:
        return _render_only(pathlib.Path(args.out), pathlib.Path(args.workdir))

    cfg = GoodputConfig(learners=args.learners, steps=args.steps, step_delay_s=args.step_delay_s,
                        mtbf_steps=args.mtbf_steps, max_fault_s=args.max_fault_s, start_step=args.start_step,
                        decoupled_quorum=args.quorum, seed=args.seed, max_wall_s=args.max_wall_s)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        print(f"unknown modes {sorted(unknown)}; choose from {MODES}", file=sys.stderr)
        return 2
    prov = results_lib.provenance()
    workdir = pathlib.Path(args.workdir)
    events = failure_schedule(cfg)
    out = {"config": dataclasses.asdict(cfg), "provenance": prov, "schedule": [e.to_json() for e in events], "modes": {}}
    for mode in modes:
        scenario = mode_scenario(cfg, mode)
        print(f"[{mode}] fault-free run", file=sys.stderr, flush=True)
        baseline = harness.run_scenario(scenario.fault_free(), [], workdir / f"{mode}-baseline",
                                        jax_cache_dir=workdir / ".jax-cache", on_event=lambda line: None)
        print(baseline.report_line, flush=True)
        print(f"[{mode}] under the failure schedule ({len(events)} faults planned)", file=sys.stderr, flush=True)
        result = harness.run_scenario(scenario, events, workdir / mode, baseline_loss=None,
                                      jax_cache_dir=workdir / ".jax-cache", on_event=lambda line: None)
        print(result.report_line, flush=True)
        out["modes"][mode] = _summary(result, baseline)
    return _write(out, pathlib.Path(args.out), workdir)


def _render_only(out_dir: pathlib.Path, workdir: pathlib.Path) -> int:
    try:
        out = json.loads((out_dir / "goodput.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"--render-only needs a goodput.json from an earlier run in {out_dir}: {exc}", file=sys.stderr)
        return 2
    return _write(out, out_dir, workdir)


def _write(out: dict, out_dir: pathlib.Path, workdir: pathlib.Path) -> int:
    add_token_milestones(out, workdir)
    json_path, md_path = results_lib.write_result(out_dir, "goodput", out, render_markdown(out))
    plot(out, out_dir / "goodput.png")
    print(f"wrote {json_path}, {md_path} and goodput.png")
    return 0 if all(r["ok"] for r in out["modes"].values()) else 1
