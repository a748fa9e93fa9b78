"""`ddiloco bench goodput`: goodput under one seeded failure schedule, Decoupled DiLoCo vs its baselines.

Every mode trains the same model on the same data with the same seed and steps per learner,
through the real services on 127.0.0.1 (the chaos harness, ddiloco/chaos/harness.py), twice: once
without faults, once under the *same* seeded failure schedule (a kill loop on the learners by
default: SIGKILL and SIGSTOP with restarts, mean time between failures --mtbf-s). Only the
syncer's configuration differs:

  * decoupled: Decoupled DiLoCo (staggered fragments, quorum K, adaptive grace window); learners
    never wait for one another;
  * diloco: synchronous DiLoCo (`--sync-mode diloco`, quorum = every learner): learners wait for
    each merge, so a dead or hung learner stalls everyone until it is back;
  * dp: data-parallel through the syncer (`--sync-mode dp`, quorum = every learner): a barrier at
    every step.

Figures per mode (the paper's headline is the first: 88 % for Decoupled DiLoCo vs 27 % for
data-parallel under heavy failures, arXiv 2604.21428):
  * goodput (time): sum over learners of the time to finish their steps without faults / the
    same sum under the faults: the share of learner time that still produced the progress a
    healthy system makes (a learner that waits for a dead peer loses time; one that trains on
    does not);
  * goodput (tokens): tokens in surviving merges / (P x tokens the learners processed): the share
    of the learners' work that reached the global model;
  * learner wait: time the learners spent blocked on the syncer / (blocked + computing);
  * final held-out loss, faulty vs fault-free, and the invariants I1-I4 of the faulty run.

Results: `goodput.json` and `goodput.md` under --out (bench/results by default), with provenance.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

from ddiloco.bench import results as results_lib

MODES = ("decoupled", "diloco", "dp")


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    learners: int = 3
    steps: int = 300
    step_delay_s: float = 0.03
    num_fragments: int = 4
    sync_period_steps: int = 4
    decoupled_quorum: int = 1
    mtbf_s: float = 4.0
    duration_s: float = 120.0  # the kill loop's span (events after training ends are not injected)
    targets: str = "learners"  # learners | all (also the syncer and the store)
    seed: int = 1


def mode_scenario(cfg: GoodputConfig, mode: str):
    """The chaos Scenario of one mode (the syncer flags are all that differs)."""
    from ddiloco.chaos import scenarios
    from ddiloco.chaos.harness import Scenario

    quorum = cfg.decoupled_quorum if mode == "decoupled" else cfg.learners
    return Scenario(name=f"goodput-{mode}", seed=cfg.seed, learners=cfg.learners, min_quorum=quorum, steps=cfg.steps,
                    step_delay_s=cfg.step_delay_s, num_fragments=cfg.num_fragments,
                    sync_period_steps=cfg.sync_period_steps,
                    syncer_args=(*scenarios.CHAOS_SYNCER_ARGS, "--sync-mode", mode), max_wall_s=900.0)


def failure_schedule(cfg: GoodputConfig):
    """One seeded schedule for every mode."""
    from ddiloco.chaos import schedule as schedule_lib

    mix = {"learner": {"kill": 2, "stop": 1}, "syncer": {"kill": 1}, "checkpoint": {"kill": 1}}
    services = ("syncer", "checkpoint") if cfg.targets == "all" else ()
    return schedule_lib.kill_loop(seed=cfg.seed, duration_s=cfg.duration_s, mtbf_s=cfg.mtbf_s, learners=cfg.learners,
                                  services=services, mix=mix, network=False, max_learners_down=1)


def _summary(result, baseline) -> dict:
    wait = sum((s or {}).get("wait_s", 0.0) for s in result.summaries.values())
    compute = sum((s or {}).get("compute_s", 0.0) for s in result.summaries.values())

    def train_s(r) -> float | None:
        return r.training_end - r.t0 if r.training_end and r.t0 else None

    def learner_s(r) -> float | None:  # summed per-learner time to finish its steps
        if not r.t0 or len(r.learner_finished_at) < r.scenario.learners:
            return None
        return sum(t - r.t0 for t in r.learner_finished_at.values())

    faulty_s, healthy_s = train_s(result), train_s(baseline)
    faulty_ls, healthy_ls = learner_s(result), learner_s(baseline)
    return {
        "ok": result.ok, "violations": result.violations()[:10], "report": result.report_line,
        "baseline_report": baseline.report_line,
        "faults_injected": len(result.faults), "not_injected": len(result.not_injected),
        "training_s": faulty_s, "baseline_training_s": healthy_s,
        "goodput_time": healthy_ls / faulty_ls if faulty_ls and healthy_ls else None,
        "goodput_tokens": result.goodput, "baseline_goodput_tokens": baseline.goodput,
        "learner_wait_fraction": wait / (wait + compute) if wait + compute else None,
        "loss": result.loss, "baseline_loss": baseline.loss,
        "recovery_s": sorted(result.recoveries),
    }


def render_markdown(result: dict) -> str:
    cfg = result["config"]
    rows = []
    for mode, r in result["modes"].items():
        pct = lambda v: f"{100 * v:.1f} %" if v is not None else "-"  # noqa: E731
        loss = (f"{r['loss']:.3f} ({r['baseline_loss']:.3f})" if r["loss"] is not None and r["baseline_loss"] is not None
                else "-")
        rows.append([mode, r["faults_injected"], pct(r["goodput_time"]), pct(r["goodput_tokens"]),
                     pct(r["learner_wait_fraction"]),
                     f"{r['training_s']:.0f} s ({r['baseline_training_s']:.0f} s)" if r["training_s"] else "-",
                     loss, "PASS" if r["ok"] else "FAIL"])
    table = results_lib.markdown_table(
        ["mode", "faults", "goodput (time)", "goodput (tokens)", "learner wait", "training (fault-free)",
         "final loss (fault-free)", "invariants"], rows)
    return (
        f"# Goodput under failures: decoupled vs synchronous DiLoCo vs data-parallel\n\n"
        f"{cfg['learners']} learners x {cfg['steps']} steps (tiny transformer), one seeded failure schedule "
        f"(seed {cfg['seed']}, MTBF {cfg['mtbf_s']} s on {cfg['targets']}); each mode once without and once with "
        f"the faults. Goodput (time) = summed per-learner time to finish without faults / with them; "
        f"goodput (tokens) = "
        f"tokens in surviving merges / (P x tokens processed).\n\n{table}\n\n"
        f"Report lines:\n\n" + "\n".join(f"- `{r['report']}`" for r in result["modes"].values()) + "\n\n"
        + results_lib.provenance_markdown(result["provenance"])
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GoodputConfig()
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of decoupled,diloco,dp")
    parser.add_argument("--learners", type=int, default=d.learners)
    parser.add_argument("--steps", type=int, default=d.steps, help="inner steps per learner")
    parser.add_argument("--step-delay-s", type=float, default=d.step_delay_s, help="pacing per inner step")
    parser.add_argument("--mtbf-s", type=float, default=d.mtbf_s, help="mean time between failures")
    parser.add_argument("--duration-s", type=float, default=d.duration_s, help="span of the failure schedule")
    parser.add_argument("--targets", choices=("learners", "all"), default=d.targets)
    parser.add_argument("--quorum", type=int, default=d.decoupled_quorum, help="decoupled mode's K")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", default=str(results_lib.DEFAULT_OUT_DIR))
    parser.add_argument("--workdir", default="runs/bench-goodput", help="the runs' processes, logs and histories")


def run(args: argparse.Namespace) -> int:
    from ddiloco.chaos import harness

    cfg = GoodputConfig(learners=args.learners, steps=args.steps, step_delay_s=args.step_delay_s, mtbf_s=args.mtbf_s,
                        duration_s=args.duration_s, targets=args.targets, decoupled_quorum=args.quorum, seed=args.seed)
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
    json_path, md_path = results_lib.write_result(pathlib.Path(args.out), "goodput", out, render_markdown(out))
    print(f"wrote {json_path} and {md_path}")
    return 0 if all(r["ok"] for r in out["modes"].values()) else 1
