"""`ddiloco bench resume`: the held-out loss cost of a learner restart, with and without resume.

Each run goes through the real services on 127.0.0.1: a syncer (the tiny transformer, 4
fragments, H = 4), two learners of --steps steps each (paced at 30 ms per step) and a final
`evaluate --once`. Three modes per seed:

- ``no-crash``: nothing happens (the reference);
- ``resume``: learner-0 runs with --state-dir (the shipped snapshot interval, 100 steps), is
  SIGKILLed at --kill-step and restarted at once with the same flags: it resumes its snapshot and
  redoes the steps since (its --steps count every life);
- ``fresh``: the same kill, restarted without --state-dir for the steps it had left: it starts
  from the global model with a fresh optimizer (warm-up again) and its un-merged work is lost.

Reports the final held-out loss of each run and each mode's difference to ``no-crash`` per seed
(mean and spread over the seeds). Writes bench/results/resume.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from ddiloco.cli import service_names
from ddiloco.bench import results as results_lib

MODES = ("no-crash", "resume", "fresh")
_TINY = ["--model-config", json.dumps({"preset": "tiny"}), "--num-fragments", "4", "--sync-period-steps", "4"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="syncer init + learner data seeds")
    parser.add_argument("--steps", type=int, default=300, help="inner steps of each learner")
    parser.add_argument("--kill-step", type=int, default=140, help="learner-0 is SIGKILLed at this step")
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--workdir", default="", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--out-dir", default=str(results_lib.DEFAULT_OUT_DIR))


def _state(address: str):
    from ddiloco.rpc import channel as channel_lib
    from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

    channel = channel_lib.sync_channel(address)
    try:
        return syncer_pb2_grpc.SyncerStub(channel).GetTrainingState(
            syncer_pb2.GetTrainingStateRequest(), timeout=5).state
    finally:
        channel.close()


def _wait_for_step(address: str, step: int, timeout_s: float = 600.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        member = next((m for m in _state(address).members if m.learner_id == "learner-0"), None)
        if member is not None and member.local_step >= step:
            return member
        time.sleep(0.2)
    raise TimeoutError(f"learner-0 did not reach step {step} in {timeout_s:g} s")


def _final_loss(cluster, eval_batches: int) -> float:
    cmd = [sys.executable, "-m", service_names.module("services.learner.evaluator"), "--once",
           "--syncer", cluster.services["syncer"].address,
           "--num-shards", "2", "--eval-batches", str(eval_batches), "--log-level", "WARNING", "--timeout-s", "120"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cluster.env, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["heldout_loss"])


def run_one(mode: str, seed: int, args: argparse.Namespace, workdir: pathlib.Path) -> dict:
    """One run to the end; returns its final held-out loss and how the restart went."""
    from ddiloco.cli import cluster as cluster_lib

    cluster = cluster_lib.LocalCluster(workdir / f"{mode}-seed{seed}")
    try:
        syncer = cluster.start_syncer(run_id=f"resume-bench-{mode}-{seed}", extra=[
            *_TINY, "--seed", str(seed)])
        # Paced (as the integration tests): two learners on a shared machine step at similar speeds.
        flags = ["--steps", str(args.steps), "--num-shards", "2", "--seed", str(seed), "--log-every-steps", "100",
                 "--step-delay-s", "0.03"]
        state_dir = ["--state-dir", str(cluster.workdir / "state" / "learner-0")] if mode == "resume" else []
        learner = cluster.start_learner(0, region="region-a", extra=[*flags, *state_dir])
        # learner-1 starts once learner-0 trains (compile times differ on a shared machine).
        _wait_for_step(syncer.address, 1)
        cluster.start_learner(1, region="region-b", extra=flags)
        restarted_at = None
        if mode != "no-crash":
            member = _wait_for_step(syncer.address, args.kill_step)
            learner.signal(signal.SIGKILL)
            learner.wait(30)
            restarted_at = member.local_step  # as last reported (the kill may come a step or two later)
            if mode == "fresh":  # the steps it had left; a resumed learner counts its earlier lives itself
                flags[1] = str(args.steps - restarted_at)
            learner = cluster.start_learner(0, region="region-a", extra=[*flags, *state_dir])
        for svc in cluster.learners():
            if svc.wait(900) is None:
                raise TimeoutError(f"{svc.name} did not finish:\n{svc.log_tail()}")
        loss = _final_loss(cluster, args.eval_batches)
        state = _state(syncer.address)
        summary = json.loads((cluster.workdir / "learner-0.summary.json").read_text())
        return {"mode": mode, "seed": seed, "final_heldout_loss": loss, "killed_at_step": restarted_at,
                "resumed_from_step": summary.get("resumed_from_step", 0),
                "tokens_processed": state.tokens_processed, "tokens_merged": state.tokens_merged,
                "work_merged": state.tokens_merged / (len(state.fragments) * state.tokens_processed)}
    finally:
        cluster.stop_all(timeout_s=15.0)


def run(args: argparse.Namespace) -> int:
    runs = []
    provenance = results_lib.provenance()
    with tempfile.TemporaryDirectory() as scratch:
        workdir = pathlib.Path(args.workdir or scratch)
        for seed in args.seeds:
            for mode in MODES:
                runs.append(run_one(mode, seed, args, workdir))
                print(json.dumps(runs[-1]), flush=True)
    base = {r["seed"]: r["final_heldout_loss"] for r in runs if r["mode"] == "no-crash"}
    summary = {}
    for mode in MODES[1:]:
        deltas = [r["final_heldout_loss"] - base[r["seed"]] for r in runs if r["mode"] == mode]
        summary[mode] = {"mean_delta": statistics.mean(deltas),
                         "stdev_delta": statistics.stdev(deltas) if len(deltas) > 1 else None, "deltas": deltas}
    result = {"what": "final held-out loss of two learners' runs; learner-0 SIGKILLed and restarted",
              "steps": args.steps, "kill_step": args.kill_step, "seeds": args.seeds,
              "runs": runs, "vs_no_crash": summary, "provenance": provenance}
    rows = [[r["seed"], r["mode"], f"{r['final_heldout_loss']:.4f}",
             f"{r['final_heldout_loss'] - base[r['seed']]:+.4f}" if r["mode"] != "no-crash" else "",
             r["killed_at_step"] or "", r["resumed_from_step"] or "", f"{100 * r['work_merged']:.1f} %"] for r in runs]
    md = "\n".join([
        "# The loss cost of a learner restart, with and without resume (`ddiloco bench resume`)", "",
        f"Tiny transformer, 4 fragments, H = 4, two learners of {args.steps} steps (paced at 30 ms per step); "
        f"learner-0 SIGKILLed at step {args.kill_step} (its snapshot: step 100, the shipped interval) and "
        "restarted at once (resume: with its --state-dir, redoing the steps since the snapshot; fresh: without, for "
        "the steps it had left). Final held-out loss by `evaluate --once` "
        f"({args.eval_batches} batches); deltas against the same seed's run without a crash.", "",
        results_lib.markdown_table(["seed", "mode", "final held-out loss", "vs no crash", "killed at",
                                    "resumed from", "work merged"], rows), "",
        results_lib.markdown_table(["mode", "mean loss delta vs no crash", "stdev over seeds"],
                                   [[m, f"{s['mean_delta']:+.4f}",
                                     f"{s['stdev_delta']:.4f}" if s["stdev_delta"] is not None else "-"]
                                    for m, s in summary.items()]), "",
        results_lib.provenance_markdown(result["provenance"]),
    ])
    json_path, md_path = results_lib.write_result(pathlib.Path(args.out_dir), "resume", result, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0
