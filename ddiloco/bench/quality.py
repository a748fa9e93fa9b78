"""`ddiloco bench quality`: held-out loss and bytes on the wire, Decoupled DiLoCo against its baselines.

Every run goes through the real services (a syncer, M learner processes and an evaluator on
127.0.0.1, started by `LocalCluster`) with the same model, data, seed and tokens per learner; only
the syncer's configuration differs:

  * dp: data-parallel through the parameter server (`--sync-mode dp`): every step each learner
    sends its fp32 gradient, the syncer averages, applies AdamW and sends the parameters back;
    learners wait (a synchronous barrier).
  * diloco: classic synchronous DiLoCo (`--sync-mode diloco`): all fragments every H steps, quorum
    = all learners, plain mean with equal weights, no grace window, fp32 both ways; learners wait
    for each merge.
  * decoupled: Decoupled DiLoCo as built: syncer-scheduled staggered rounds, K = 1 with the
    adaptive grace window, rebase on arrival, 4-bit uploads and (here) 4-bit error-fed delta
    downloads; learners never wait.
  * ablations of decoupled (one change each): on-arrival rule (overwrite, mix), merge rule (mean),
    upload codec (fp32, int8, int2), download codec (fp32), K and the grace window with learners of
    mixed speeds, the outer step (by the learners' share too; whole), and the previous round design
    (learners' own counters open rounds).

Every mode runs once per seed (`--seeds`); the report gives the mean and spread over seeds. A
seed fixes the initialization and each learner's data order (learners run as their first life,
incarnation 1: a learner's data order otherwise mixes in its start time); merge timing still
varies from run to run, which is what the spread measures. The
work merged of a run is tokens_merged / (P x tokens processed): the share of the learners' work that
reached the global model.

Bytes are what the syncer counts per learner: the serialized size of every gRPC message to and
from that learner (uploads, downloads, joins, progress reports); the evaluator's reads are not
training traffic and are excluded. Results: `quality.json`, `quality.md` and `quality.png` under
`--out`, with the machine, the commit and the exact configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
import subprocess
import sys
import time

from ddiloco.cli import service_names
from ddiloco.bench import results as results_lib
from ddiloco.bench.quality_report import (  # noqa: F401 (the targets: re-exported, part of this benchmark's interface)
    SLOW_FACTOR,
    SLOW_JITTER,
    TARGET_BYTES_RATIO,
    TARGET_LOSS_GAP_PCT,
    TARGET_WORK_MERGED,
    plot,
    render_markdown,
    run_key,
    summarize,
)

# Compute utilization the required link speed is computed for.
TARGET_UTILIZATION = 0.95


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything shared by all runs of one invocation."""

    preset: str = "tiny"
    learners: int = 4
    steps: int = 1920  # inner steps per learner (equal tokens per learner in every run): 30 x H
    batch_size: int = 64
    num_fragments: int = 4  # P (decoupled and diloco)
    sync_period_steps: int = 64  # H (decoupled and diloco)
    overlap_steps: int = 4  # tau (the syncer's default)
    learning_rate: float = 2e-3  # learners' inner AdamW, and the dp syncer's AdamW
    warmup_steps: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    download_codec: str = ""  # decoupled's download codec; empty: the syncer's default (int4 deltas)
    eval_interval_s: float = 30.0
    eval_batches: int = 8  # per periodic evaluation
    final_eval_batches: int = 64
    data_dir: str = ""
    seeds: tuple[int, ...] = (0, 1, 2)  # every mode runs once per seed; ablations at ablation_seed
    ablation_seed: int = 0
    run_timeout_s: float = 3600.0


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run: a name, the table it belongs to and how it differs from the shared config."""

    name: str
    group: str  # "mode" or the ablation's name
    sync_mode: str
    syncer_flags: tuple[str, ...] = ()
    slow_learners: bool = False  # half the learners SLOW_FACTOR slower with SLOW_JITTER jitter
    note: str = ""
    seed: int = 0


def decoupled_flags(cfg: BenchConfig) -> tuple[str, ...]:
    """Decoupled runs: the syncer's shipped defaults (int4 uploads, int4 error-fed delta
    downloads, rebase, scheduled rounds, K = 1 + grace, fractional outer steps); --download-codec
    overrides the download codec."""
    return ("--download-codec", cfg.download_codec) if cfg.download_codec else ()


def mode_specs(cfg: BenchConfig) -> dict[str, RunSpec]:
    m = str(cfg.learners)
    return {
        "dp": RunSpec("dp", "mode", "dp", ("--min-quorum", m), note="fp32 gradients every step, AdamW on the syncer"),
        "diloco": RunSpec("diloco", "mode", "diloco", ("--min-quorum", m),
                          note="classic: all fragments every H, K = M, equal-weight mean, fp32"),
        "decoupled": RunSpec("decoupled", "mode", "decoupled", decoupled_flags(cfg),
                             note="scheduled rounds, K = 1 + grace, rebase, int4 up, "
                                  f"{cfg.download_codec or 'int4'} deltas down, fractional outer steps"),
    }


def ablation_specs(cfg: BenchConfig) -> dict[str, RunSpec]:
    base = decoupled_flags(cfg)

    def with_flag(flag: str, value: str) -> tuple[str, ...]:
        flags = list(base)
        if flag in flags:
            flags[flags.index(flag) + 1] = value
        else:
            flags += [flag, value]
        return tuple(flags)

    half = str(max(1, cfg.learners // 2))
    specs = [
        RunSpec("arrival-overwrite", "on-arrival rule", "decoupled", with_flag("--on-arrival", "overwrite"),
                note="the paper's rule: local = global, counters reset (un-merged work is lost)"),
        RunSpec("arrival-mix", "on-arrival rule", "decoupled",
                with_flag("--on-arrival", "mix") + ("--mixing-alpha", "0.5"), note="local*0.5 + global*0.5"),
        RunSpec("merge-mean", "merge rule", "decoupled", with_flag("--merge-rule", "mean"),
                note="token-weighted mean instead of radial-directional averaging"),
        RunSpec("hetero-grace", "mixed speeds", "decoupled", base, slow_learners=True,
                note="half the learners 1.5x slower; K = 1 + adaptive grace (defaults)"),
        RunSpec("hetero-nograce", "mixed speeds", "decoupled", with_flag("--max-grace-s", "0"),
                slow_learners=True, note="half 1.5x slower; K = 1, no grace window"),
        RunSpec("hetero-k-half", "mixed speeds", "decoupled", with_flag("--min-quorum", half),
                slow_learners=True, note=f"half 1.5x slower; K = {half} + grace"),
        RunSpec("upload-fp32", "upload codec", "decoupled", with_flag("--upload-codec", "fp32")),
        RunSpec("upload-int8", "upload codec", "decoupled", with_flag("--upload-codec", "int8")),
        RunSpec("upload-int2", "upload codec", "decoupled", with_flag("--upload-codec", "int2")),
        RunSpec("download-fp32", "download codec", "decoupled", with_flag("--download-codec", "fp32"),
                note="global fragments sent whole in fp32 instead of error-fed int4 deltas"),
        RunSpec("outer-steps", "outer step", "decoupled", with_flag("--outer-step-fraction", "steps"),
                note="a partial merge takes a whole round's step whatever the learners (the previous default)"),
        RunSpec("outer-whole", "outer step", "decoupled", with_flag("--outer-step-fraction", "whole"),
                note="every merge a whole Nesterov step, however few inner steps it holds"),
        RunSpec("rounds-by-learners", "round design", "decoupled", with_flag("--round-trigger", "upload"),
                note="the previous design: each learner's counter opens rounds (rebase kept)"),
    ]
    return {s.name: s for s in specs}


# ------------------------------------------------------------------------------------ one run


def _final_eval(cluster, cfg: BenchConfig) -> float | None:
    cmd = [sys.executable, "-m", service_names.module("services.learner.evaluator"), "--once",
           "--syncer", cluster.services["syncer"].address,
           "--num-shards", str(cfg.learners), "--eval-batches", str(cfg.final_eval_batches), "--log-level", "WARNING",
           "--timeout-s", "120"]
    if cfg.data_dir:
        cmd += ["--data-dir", cfg.data_dir]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cluster.env, check=True).stdout
        return float(json.loads(out.strip().splitlines()[-1])["heldout_loss"])
    except (subprocess.SubprocessError, ValueError, IndexError, KeyError):
        return None


def run_one(spec: RunSpec, cfg: BenchConfig, workdir: pathlib.Path, *, base_step_s: float | None = None,
            log=print) -> dict:
    """Runs one configuration to the end; returns its measurements."""
    from ddiloco.cli import cluster as cluster_lib
    from ddiloco.rpc import channel as channel_lib
    from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

    if workdir.exists():
        shutil.rmtree(workdir)
    cluster = cluster_lib.LocalCluster(workdir)
    started = time.monotonic()
    samples: list[dict] = []  # (wall time, tokens trained, bytes) over the run
    merges: dict[tuple[int, int], tuple[int, int]] = {}  # (fragment, version) -> (contributors, expected)
    try:
        syncer = _start_services(cluster, spec, cfg, base_step_s)
        stub = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(syncer.address))
        request = syncer_pb2.GetTrainingStateRequest(recent_merges=256)
        _sample_until_learners_exit(cluster, stub, request, spec, started + cfg.run_timeout_s, cfg, samples, merges)
        _wait_for_pending_merges(stub, request)
        final_loss = _final_eval(cluster, cfg)
        state = stub.GetTrainingState(request, timeout=10).state
        _record_merges(state, merges)
    finally:
        cluster.stop_all(timeout_s=15.0)
    wall_s = time.monotonic() - started
    summaries = []
    for svc in cluster.learners():
        path = workdir / f"{svc.name}.summary.json"
        summaries.append(json.loads(path.read_text()) if path.exists() else {})
    result = _run_result(spec, cfg, state, summaries, merges, samples, final_loss, wall_s)
    loss = f"{final_loss:.4f}" if final_loss is not None else "n/a"
    merged = f"{100 * result['work_merged']:.1f}%" if result["work_merged"] is not None else "n/a"
    log(f"  {spec.name} (seed {spec.seed}): held-out {loss} nats/token, {result['bytes_total'] / 2**20:.1f} MiB on "
        f"the wire, {state.outer_steps} merges, work merged {merged}, {wall_s:.0f} s", flush=True)
    return result


def _start_services(cluster, spec: RunSpec, cfg: BenchConfig, base_step_s: float | None):
    """Starts the run's syncer, evaluator and learners; returns the syncer's service."""
    syncer = cluster.start_syncer(run_id=f"bench-{spec.name}", extra=[
        "--sync-mode", spec.sync_mode, "--model-config", json.dumps({"preset": cfg.preset}),
        "--num-fragments", str(cfg.num_fragments), "--sync-period-steps", str(cfg.sync_period_steps),
        "--overlap-steps", str(cfg.overlap_steps), "--outer-lr", str(cfg.outer_lr),
        "--outer-momentum", str(cfg.outer_momentum), "--dp-learning-rate", str(cfg.learning_rate),
        "--dp-warmup-steps", str(cfg.warmup_steps),
        # dp's AdamW decays over the same steps as the learners' (their default over --steps)
        "--dp-decay-steps", str(cfg.steps), "--seed", str(spec.seed), "--log-level", "WARNING",
        *spec.syncer_flags,
    ])
    data = ["--data-dir", cfg.data_dir] if cfg.data_dir else []
    cluster.start_evaluator(extra=["--interval-s", str(cfg.eval_interval_s), "--num-shards", str(cfg.learners),
                                   "--eval-batches", str(cfg.eval_batches), "--log-level", "WARNING", *data])
    slow = set(range(cfg.learners // 2, cfg.learners)) if spec.slow_learners else set()
    for i in range(cfg.learners):
        extra = ["--steps", str(cfg.steps), "--num-shards", str(cfg.learners), "--batch-size", str(cfg.batch_size),
                 "--learning-rate", str(cfg.learning_rate), "--warmup-steps", str(cfg.warmup_steps),
                 "--seed", str(spec.seed), "--incarnation", "1",
                 "--log-every-steps", "1000", "--log-level", "WARNING", *data]
        if i in slow:
            if not base_step_s:
                raise ValueError("the heterogeneous ablation needs the measured step time of a previous run")
            delay_s = SLOW_FACTOR * base_step_s
            # Jitter of SLOW_JITTER of the whole (slowed) step, expressed relative to the delay.
            extra += ["--step-delay-s", f"{delay_s:.4f}",
                      "--step-jitter", f"{SLOW_JITTER * (base_step_s + delay_s) / delay_s:.4f}"]
        cluster.start_learner(i, region="region-a" if i % 2 == 0 else "region-b", extra=extra)
    return syncer


def _record_merges(state, merges: dict) -> None:
    for m in state.recent_merges:
        merges[(m.fragment_id, m.version)] = (len(m.contributors), m.expected_contributors)


def _sample_until_learners_exit(cluster, stub, request, spec: RunSpec, deadline: float, cfg: BenchConfig,
                                samples: list[dict], merges: dict) -> None:
    """Samples the training state every second until every learner has exited (TimeoutError past
    `deadline`, a monotonic time); RuntimeError with a log tail if a learner failed."""
    while any(s.alive() for s in cluster.learners()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{spec.name}: learners still running after {cfg.run_timeout_s:.0f} s")
        try:
            state = stub.GetTrainingState(request, timeout=10).state
            _record_merges(state, merges)
            samples.append({"t": state.now_unix_s, "tokens": sum(m.tokens_total for m in state.members),
                            "bytes": sum(m.bytes_in + m.bytes_out for m in state.members)})
        except Exception:  # noqa: BLE001 - a busy syncer: sample again next time
            pass
        time.sleep(1.0)
    failed = [s.name for s in cluster.learners() if s.proc.returncode != 0]
    if failed:
        raise RuntimeError(f"{spec.name}: learners {failed} failed:\n" + cluster.services[failed[0]].log_tail())


def _wait_for_pending_merges(stub, request) -> None:
    """Lets the last contributions merge (decoupled: after the grace window), for at most 30 s."""
    settle_deadline = time.monotonic() + 30.0
    while time.monotonic() < settle_deadline:
        state = stub.GetTrainingState(request, timeout=10).state
        if all(f.pending_contributions == 0 for f in state.fragments):
            break
        time.sleep(0.5)


def _run_result(spec: RunSpec, cfg: BenchConfig, state, summaries: list[dict], merges: dict, samples: list[dict],
                final_loss: float | None, wall_s: float) -> dict:
    """One run's measurements, from the syncer's final state and the learners' own summaries."""
    members = sorted(state.members, key=lambda m: m.learner_id)
    curve = _loss_curve(list(state.evals), samples)
    if final_loss is not None:
        curve.append({"tokens": sum(s.get("tokens", m.tokens_total) for m, s in zip(members, summaries)),
                      "heldout_loss": final_loss, "final": True})
    tokens_trained = sum(s.get("tokens", m.tokens_total) for m, s in zip(members, summaries))
    num_fragments = len(state.config.fragments) or cfg.num_fragments
    # Mid-run merges only (the final flush merges whatever the finished learners sent, alone or not).
    during = [(c, e) for c, e in merges.values() if e >= cfg.learners]
    result = {
        "name": spec.name, "group": spec.group, "sync_mode": spec.sync_mode, "note": spec.note, "seed": spec.seed,
        # tokens_merged counts each contribution's tokens once per fragment it carried
        "work_merged": state.tokens_merged / (num_fragments * tokens_trained) if tokens_trained else None,
        "tokens_merged": state.tokens_merged,
        "contributors_per_merge": (sum(c for c, _ in merges.values()) / len(merges)) if merges else None,
        "contributors_per_merge_all_live": (sum(c for c, _ in during) / len(during)) if during else None,
        "merges_seen": len(merges),
        "learners_finished_all_merged": sum(bool(s.get("finish", {}).get("all_merged")) for s in summaries),
        "syncer_flags": list(spec.syncer_flags), "slow_learners": spec.slow_learners,
        "final_heldout_loss": final_loss,
        "first_heldout_loss": state.evals[0].heldout_loss if state.evals else None,
        "wall_s": round(wall_s, 1),
        "outer_steps": state.outer_steps,
        # The learners' own counts (their last progress report may not reach the syncer before they leave).
        "tokens_trained": tokens_trained,
        "bytes_total": sum(m.bytes_in + m.bytes_out for m in members),
        "bytes_up": sum(m.bytes_in for m in members),
        "bytes_down": sum(m.bytes_out for m in members),
        "per_learner": [
            {"learner_id": m.learner_id, "bytes_up": m.bytes_in, "bytes_down": m.bytes_out,
             "steps": s.get("steps", m.local_step),
             "tokens": s.get("tokens", m.tokens_total), "uploads_accepted": m.uploads_accepted,
             "compute_s": s.get("compute_s"), "wait_s": s.get("wait_s"), "wall_s": s.get("wall_s")}
            for m, s in zip(members, summaries)
        ],
        "uploads": dict(state.uploads),
        "curve": curve,
    }
    result.update(_derived(result, state.config))
    return result


def _loss_curve(evals, samples: list[dict]) -> list[dict]:
    """Periodic evaluations placed at the tokens the learners had trained when they were taken."""
    curve = []
    for e in evals:
        before = [s for s in samples if s["t"] <= e.at_unix_s]
        tokens = before[-1]["tokens"] if before else 0
        curve.append({"tokens": tokens, "heldout_loss": e.heldout_loss})
    return curve


def _derived(result: dict, config) -> dict:
    """Per-step figures and the link speed each mode needs (see the report's definitions)."""
    learners = result["per_learner"]
    steps = max(1, sum(p["steps"] for p in learners) / max(1, len(learners)))
    compute = sorted(p["compute_s"] / max(1, p["steps"]) for p in learners if p.get("compute_s"))
    step_s = compute[len(compute) // 2] if compute else float("nan")
    waits = [p["wait_s"] / p["wall_s"] for p in learners if p.get("wall_s")]
    bytes_per_learner = result["bytes_total"] / max(1, len(learners))
    bytes_per_step = bytes_per_learner / steps
    h = max(1, config.sync_period_steps)
    tau = config.overlap_steps
    numel = [f.numel for f in config.fragments]
    largest_share = max(numel) / sum(numel) if numel else 1.0
    blocking = result["sync_mode"] in ("dp", "diloco")
    if blocking:
        # All of a learner's traffic for one sync happens at one step, and the learner waits for
        # it: per sync B = bytes_per_step * H must cross in (1/U - 1) * H * step_s.
        peak_bytes_per_step = bytes_per_step * h
        budget_s = (1.0 / TARGET_UTILIZATION - 1.0) * h * step_s
        link_bps = 8 * peak_bytes_per_step / budget_s if budget_s > 0 else float("nan")
    else:
        # Never waits: one fragment's up + down traffic must cross within tau steps (the overlap
        # the schedule allows), and the average rate must be sustained.
        peak_bytes_per_step = bytes_per_step * h * largest_share * math.ceil(len(numel) / h)
        sync_bytes = bytes_per_step * h * largest_share
        link_bps = max(8 * sync_bytes / (max(tau, 1) * step_s), 8 * bytes_per_step / step_s)
    return {
        "step_s": step_s,
        "wait_share": sum(waits) / len(waits) if waits else None,
        "bytes_per_step_per_learner": bytes_per_step,
        "peak_bytes_per_step_per_learner": peak_bytes_per_step,
        "link_bps_for_95pct": link_bps,
    }


# --------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--quick", action="store_true",
                        help="a fast smoke configuration (tiny model, 2 learners, few steps): for tests, not results")
    parser.add_argument("--modes", default="dp,diloco,decoupled", help="comma-separated modes to run")
    parser.add_argument("--ablations", default="all",
                        help="comma-separated ablations, 'all' or 'none': " + ", ".join(ablation_specs(d)))
    parser.add_argument("--preset", default=d.preset)
    parser.add_argument("--learners", type=int, default=d.learners)
    parser.add_argument("--steps", type=int, default=d.steps, help="inner steps per learner")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--num-fragments", type=int, default=d.num_fragments)
    parser.add_argument("--sync-period-steps", type=int, default=d.sync_period_steps)
    parser.add_argument("--download-codec", default=d.download_codec,
                        help="decoupled's download codec (default: the syncer's, int4 deltas)")
    parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
    parser.add_argument("--data-dir", default="", help="training data (see `ddiloco learner --help`)")
    parser.add_argument("--seeds", default=",".join(str(x) for x in d.seeds),
                        help="comma-separated seeds: every mode runs once per seed")
    parser.add_argument("--ablation-seed", type=int, default=d.ablation_seed, help="the seed the ablations run at")
    parser.add_argument("--eval-interval-s", type=float, default=d.eval_interval_s)
    parser.add_argument("--final-eval-batches", type=int, default=d.final_eval_batches)
    parser.add_argument("--out", default=str(results_lib.DEFAULT_OUT_DIR), help="where the results go")
    parser.add_argument("--workdir", default="runs/bench-quality", help="logs of every run")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    seeds = tuple(int(x) for x in args.seeds.split(",") if x.strip())
    if args.quick:
        return BenchConfig(preset="tiny", learners=2, steps=24, batch_size=8, num_fragments=4, sync_period_steps=8,
                           eval_interval_s=2.0, eval_batches=2, final_eval_batches=4, data_dir=args.data_dir,
                           download_codec=args.download_codec, run_timeout_s=300.0, seeds=seeds[:1] or (0,),
                           ablation_seed=args.ablation_seed)
    return BenchConfig(preset=args.preset, learners=args.learners, steps=args.steps, batch_size=args.batch_size,
                       num_fragments=args.num_fragments, sync_period_steps=args.sync_period_steps,
                       download_codec=args.download_codec, learning_rate=args.learning_rate, data_dir=args.data_dir,
                       eval_interval_s=args.eval_interval_s, final_eval_batches=args.final_eval_batches, seeds=seeds,
                       ablation_seed=args.ablation_seed)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    modes = mode_specs(cfg)
    wanted_modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in wanted_modes if m not in modes]
    all_ablations = ablation_specs(cfg)
    wanted_ablations = (list(all_ablations) if args.ablations == "all" else
                        [] if args.ablations in ("", "none") else args.ablations.split(","))
    unknown += [a for a in wanted_ablations if a not in all_ablations]
    if unknown:
        print(f"unknown modes/ablations: {unknown}", file=sys.stderr)
        return 2
    specs = [dataclasses.replace(modes[m], seed=seed) for seed in cfg.seeds for m in wanted_modes]
    specs += [dataclasses.replace(all_ablations[a], seed=cfg.ablation_seed) for a in wanted_ablations]
    prov = results_lib.provenance()
    workdir = pathlib.Path(args.workdir)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"ddiloco bench quality: {len(specs)} runs of {cfg.learners} learners x {cfg.steps} steps ({cfg.preset}); "
          f"logs under {workdir}")
    runs: dict[str, dict] = {}
    base_step_s = None
    for spec in specs:
        if spec.slow_learners and base_step_s is None:
            base_step_s = next((r["step_s"] for r in runs.values() if r["sync_mode"] == "decoupled"
                                and math.isfinite(r["step_s"])), None)
        key = run_key(spec.name, spec.seed)
        runs[key] = run_one(spec, cfg, workdir / key.replace("/", "-"), base_step_s=base_step_s)
        partial = {"benchmark": "quality", "config": dataclasses.asdict(cfg), "runs": runs, "summary": summarize(runs),
                   "provenance": prov, "notes": [f"partial: {len(runs)} of {len(specs)} runs done"]}
        # Written after every run: a long invocation that is stopped keeps what it measured.
        results_lib.write_result(out_dir, "quality-partial", partial, render_markdown(partial))
    result = {
        "benchmark": "quality",
        "config": dataclasses.asdict(cfg),
        "runs": runs,
        "summary": summarize(runs),
        "provenance": prov,
        "notes": [
            "dp uses the learners' AdamW hyperparameters unchanged at a larger global batch (no LR re-tuning "
            "for any mode); every parameter of this configuration was fixed before the run.",
            "decoupled's downloads are error-fed deltas in the download codec; a learner that missed a version gets "
            "exact fp32 values.",
        ] if not args.quick else ["--quick smoke configuration: not a result."],
    }
    for stale in ("quality-partial.json", "quality-partial.md"):
        (out_dir / stale).unlink(missing_ok=True)
    result["plot"] = str(plot(result, out_dir / "quality.png"))
    json_path, md_path = results_lib.write_result(out_dir, "quality", result, render_markdown(result))
    print(f"wrote {json_path}, {md_path} and {result['plot']}")
    return 0
