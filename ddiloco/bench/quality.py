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
    upload codec (fp32, int8, int2), K and the grace window with learners of mixed speeds, and the
    previous round design (learners' own counters open rounds).

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

from ddiloco.bench import results as results_lib

# Targets (issue 20): decoupled's held-out loss within 1% of classic DiLoCo's at the same H, at least
# 400x fewer bytes than data-parallel at equal tokens, and at least 95% of the work merged.
TARGET_LOSS_GAP_PCT = 1.0
TARGET_BYTES_RATIO = 400.0
TARGET_WORK_MERGED = 0.95
# Compute utilization the required link speed is computed for.
TARGET_UTILIZATION = 0.95
# Mixed-speed ablations: half the learners this much slower (1.5x the step time), with this much
# jitter on their step time.
SLOW_FACTOR = 0.5
SLOW_JITTER = 0.10


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
        RunSpec("outer-whole", "outer step", "decoupled", with_flag("--outer-step-fraction", "whole"),
                note="every merge a whole Nesterov step, however few inner steps it holds"),
        RunSpec("rounds-by-learners", "round design", "decoupled", with_flag("--round-trigger", "upload"),
                note="the previous design: each learner's counter opens rounds (rebase kept)"),
    ]
    return {s.name: s for s in specs}


# ------------------------------------------------------------------------------------ one run


def _final_eval(cluster, cfg: BenchConfig) -> float | None:
    cmd = [sys.executable, "-m", "services.learner.evaluator", "--once", "--syncer", cluster.services["syncer"].address,
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
    try:
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
        stub = syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(syncer.address))
        request = syncer_pb2.GetTrainingStateRequest(recent_merges=256)
        deadline = started + cfg.run_timeout_s
        merges: dict[tuple[int, int], tuple[int, int]] = {}  # (fragment, version) -> (contributors, expected)

        def record_merges(state) -> None:
            for m in state.recent_merges:
                merges[(m.fragment_id, m.version)] = (len(m.contributors), m.expected_contributors)

        while any(s.alive() for s in cluster.learners()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.name}: learners still running after {cfg.run_timeout_s:.0f} s")
            try:
                state = stub.GetTrainingState(request, timeout=10).state
                record_merges(state)
                samples.append({"t": state.now_unix_s, "tokens": sum(m.tokens_total for m in state.members),
                                "bytes": sum(m.bytes_in + m.bytes_out for m in state.members)})
            except Exception:  # noqa: BLE001 - a busy syncer: sample again next time
                pass
            time.sleep(1.0)
        failed = [s.name for s in cluster.learners() if s.proc.returncode != 0]
        if failed:
            raise RuntimeError(f"{spec.name}: learners {failed} failed:\n" + cluster.services[failed[0]].log_tail())
        # Let the last contributions merge (decoupled: after the grace window).
        settle_deadline = time.monotonic() + 30.0
        while time.monotonic() < settle_deadline:
            state = stub.GetTrainingState(request, timeout=10).state
            if all(f.pending_contributions == 0 for f in state.fragments):
                break
            time.sleep(0.5)
        final_loss = _final_eval(cluster, cfg)
        state = stub.GetTrainingState(request, timeout=10).state
        record_merges(state)
    finally:
        cluster.stop_all(timeout_s=15.0)
    wall_s = time.monotonic() - started
    summaries = []
    for svc in cluster.learners():
        path = workdir / f"{svc.name}.summary.json"
        summaries.append(json.loads(path.read_text()) if path.exists() else {})
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
    loss = f"{final_loss:.4f}" if final_loss is not None else "n/a"
    merged = f"{100 * result['work_merged']:.1f}%" if result["work_merged"] is not None else "n/a"
    log(f"  {spec.name} (seed {spec.seed}): held-out {loss} nats/token, {result['bytes_total'] / 2**20:.1f} MiB on "
        f"the wire, {state.outer_steps} merges, work merged {merged}, {wall_s:.0f} s", flush=True)
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


# ------------------------------------------------------------------------------------ report


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt_bps(bps: float) -> str:
    if not math.isfinite(bps):
        return "n/a"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.2f} {unit}"
    return f"{bps:.0f} bit/s"


def _stats(values: list[float]) -> dict:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return {"n": len(values), "mean": mean, "std": std, "min": min(values), "max": max(values)}


def run_key(name: str, seed: int) -> str:
    return f"{name}/seed{seed}"


def summarize(runs: dict[str, dict]) -> dict:
    """Mean and spread over seeds per configuration, comparisons against dp and DiLoCo (same seed),
    and the targets."""
    by_name: dict[str, list[dict]] = {}
    for r in runs.values():
        by_name.setdefault(r["name"], []).append(r)
    for r in runs.values():
        dp = runs.get(run_key("dp", r["seed"]))
        diloco = runs.get(run_key("diloco", r["seed"]))
        if dp and r.get("final_heldout_loss") and dp.get("final_heldout_loss"):
            r["loss_vs_dp_pct"] = 100.0 * (r["final_heldout_loss"] - dp["final_heldout_loss"]) / dp["final_heldout_loss"]
        if diloco and r.get("final_heldout_loss") and diloco.get("final_heldout_loss"):
            r["loss_vs_diloco_pct"] = (100.0 * (r["final_heldout_loss"] - diloco["final_heldout_loss"])
                                       / diloco["final_heldout_loss"])
        if dp:
            r["dp_bytes_ratio"] = dp["bytes_total"] / max(1, r["bytes_total"])
    aggregate = {}
    for name, rs in by_name.items():
        aggregate[name] = {
            "group": rs[0]["group"], "note": rs[0].get("note", ""), "seeds": sorted(r["seed"] for r in rs),
            **{key: _stats([r.get(key) for r in rs]) for key in (
                "final_heldout_loss", "loss_vs_dp_pct", "loss_vs_diloco_pct", "bytes_total", "dp_bytes_ratio",
                "work_merged", "contributors_per_merge", "contributors_per_merge_all_live", "outer_steps", "wall_s",
                "step_s", "wait_share")},
        }
    out: dict = {"aggregate": aggregate}
    dec = aggregate.get("decoupled")
    if dec:
        targets = {}
        gap = dec["loss_vs_diloco_pct"]
        if gap["n"]:
            out["decoupled_vs_diloco_loss_pct"] = gap["mean"]
            targets["loss_within_1pct_of_diloco"] = {"target_pct": TARGET_LOSS_GAP_PCT, "measured_pct": gap["mean"],
                                                     "spread_pct": [gap["min"], gap["max"]],
                                                     "met": gap["mean"] <= TARGET_LOSS_GAP_PCT}
        ratio = dec["dp_bytes_ratio"]
        if ratio["n"]:
            out["dp_over_decoupled_bytes"] = ratio["mean"]
            targets["bytes_400x_fewer_than_dp"] = {"target_ratio": TARGET_BYTES_RATIO, "measured_ratio": ratio["mean"],
                                                   "spread": [ratio["min"], ratio["max"]],
                                                   "met": ratio["min"] >= TARGET_BYTES_RATIO}
        merged = dec["work_merged"]
        if merged["n"]:
            targets["work_merged_95pct"] = {"target": TARGET_WORK_MERGED, "measured": merged["mean"],
                                            "spread": [merged["min"], merged["max"]],
                                            "met": merged["min"] >= TARGET_WORK_MERGED}
        out["targets"] = targets
    return out


def _pm(stats: dict, fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    if not stats or not stats.get("n"):
        return "n/a"
    mean = format(stats["mean"] * scale, fmt) + suffix
    if stats["n"] < 2:
        return mean
    return f"{mean} ± {format(stats['std'] * scale, fmt)}{suffix} [{format(stats['min'] * scale, fmt)}, " \
           f"{format(stats['max'] * scale, fmt)}]"


def render_markdown(result: dict) -> str:
    cfg = result["config"]
    runs = result["runs"]
    summary = result["summary"]
    agg = summary["aggregate"]
    lines = ["# Quality and bandwidth: Decoupled DiLoCo vs classic DiLoCo vs data-parallel", ""]
    lines.append(
        f"{cfg['learners']} learners x {cfg['steps']} steps x batch {cfg['batch_size']} (equal tokens per learner), "
        f"`{cfg['preset']}` transformer, P = {cfg['num_fragments']}, H = {cfg['sync_period_steps']} "
        f"({cfg['steps'] // max(1, cfg['sync_period_steps'])} outer steps per fragment), "
        f"tau = {cfg['overlap_steps']}, inner AdamW lr {cfg['learning_rate']} (warm-up {cfg['warmup_steps']} steps, "
        f"then cosine decay to 0.1x at the last step: the learners' default over --steps, dp's AdamW alike), "
        f"outer Nesterov "
        f"{cfg['outer_lr']}/{cfg['outer_momentum']}; data: {cfg['data_dir'] or 'Python stdlib sources (bytes)'}; "
        f"modes at seeds {list(cfg['seeds'])}, ablations at seed {cfg['ablation_seed']}. "
        f"Held-out loss in nats per token of the global model on the held-out split "
        f"({cfg['final_eval_batches']} batches); bytes = serialized gRPC messages to and from learners. "
        "Figures are mean ± sample std [min, max] over seeds.")
    lines.append("")
    t = summary.get("targets", {})
    if t:
        lines.append("## Targets")
        if "loss_within_1pct_of_diloco" in t:
            g = t["loss_within_1pct_of_diloco"]
            lines.append(f"- decoupled within {TARGET_LOSS_GAP_PCT:g}% of classic DiLoCo's held-out loss (same seed, "
                         f"mean over seeds): measured {g['measured_pct']:+.2f}% (per seed {g['spread_pct'][0]:+.2f}% "
                         f"to {g['spread_pct'][1]:+.2f}%) -> **{'met' if g['met'] else 'MISSED'}**")
        if "bytes_400x_fewer_than_dp" in t:
            b = t["bytes_400x_fewer_than_dp"]
            lines.append(f"- at least {TARGET_BYTES_RATIO:g}x fewer bytes than dp at equal tokens (every seed): "
                         f"measured {b['measured_ratio']:.0f}x (min {b['spread'][0]:.0f}x) -> "
                         f"**{'met' if b['met'] else 'MISSED'}**")
        if "work_merged_95pct" in t:
            w = t["work_merged_95pct"]
            lines.append(f"- decoupled work merged (tokens_merged / (P x tokens processed)) at least "
                         f"{TARGET_WORK_MERGED:.0%} in every seed: measured {100 * w['measured']:.2f}% "
                         f"(min {100 * w['spread'][0]:.2f}%) -> **{'met' if w['met'] else 'MISSED'}**")
        lines.append("")

    def table(names: list[str]) -> str:
        rows = []
        for name in names:
            a = agg[name]
            rows.append([
                name, len(a["seeds"]), _pm(a["final_heldout_loss"], ".4f"), _pm(a["loss_vs_diloco_pct"], "+.2f", suffix="%"),
                _pm(a["loss_vs_dp_pct"], "+.2f", suffix="%"), _pm(a["work_merged"], ".1f", 100, "%"),
                _pm(a["contributors_per_merge_all_live"], ".2f"), _pm(a["dp_bytes_ratio"], ".0f", suffix="x"),
                _pm(a["outer_steps"], ".0f"), _pm(a["wait_share"], ".1f", 100, "%"), _pm(a["wall_s"], ".0f", suffix=" s"),
                a.get("note", ""),
            ])
        return results_lib.markdown_table(
            ["run", "seeds", "held-out loss", "vs diloco", "vs dp", "work merged", "contributors/merge (all live)",
             "dp bytes / run", "merges", "time waiting", "wall", "what"], rows)

    modes = [n for n in ("dp", "diloco", "decoupled") if n in agg]
    lines += ["## Modes", "", table(modes), ""]
    ablations = [n for n, a in agg.items() if a["group"] != "mode"]
    if ablations:
        lines += [f"## Ablations (decoupled, one change each, seed {cfg['ablation_seed']}; compare with decoupled "
                  "at that seed below)", "", table(ablations), ""]
    rows = []
    for key, r in runs.items():
        loss = r.get("final_heldout_loss")
        rows.append([key, f"{loss:.4f}" if loss is not None else "n/a",
                     f"{r['loss_vs_diloco_pct']:+.2f}%" if "loss_vs_diloco_pct" in r else "",
                     f"{100 * r['work_merged']:.2f}%" if r.get("work_merged") is not None else "n/a",
                     f"{r['contributors_per_merge_all_live']:.2f}" if r.get("contributors_per_merge_all_live") else "n/a",
                     _fmt_bytes(r["bytes_total"]), _fmt_bytes(r["bytes_up"]), _fmt_bytes(r["bytes_down"]),
                     f"{r['dp_bytes_ratio']:.0f}x" if "dp_bytes_ratio" in r else "",
                     f"{r['step_s'] * 1000:.0f} ms" if math.isfinite(r["step_s"]) else "n/a",
                     _fmt_bps(r["link_bps_for_95pct"]), r["outer_steps"], f"{r['wall_s']:.0f} s"])
    lines += ["## Every run", "", results_lib.markdown_table(
        ["run", "held-out loss", "vs diloco", "work merged", "contributors/merge (all live)", "bytes", "up", "down",
         "dp / run", "compute/step", "link for 95% CU", "merges", "wall"], rows), ""]
    lines += [
        "## Definitions",
        "- *work merged*: tokens in merged contributions / (P x tokens the learners processed); each inner step "
        "trains all P fragments and each fragment's contribution carries that fragment's tokens, so 100% means every "
        "token of every learner reached the global model in every fragment.",
        "- *contributors/merge (all live)*: mean contributors of the merges whose round waited for every learner "
        f"(expected = {cfg['learners']}); merges of the end-of-training flush, when learners have finished, are "
        "excluded.",
        "- *vs diloco* / *vs dp*: relative held-out loss against the same seed's run of that mode.",
        "- *link for 95% CU*: dp/diloco block, so one sync's bytes must cross in (1/0.95 - 1) x H compute steps; "
        "decoupled never blocks, so the largest fragment's up+down bytes must cross within tau steps and the mean "
        "rate must be sustained. Latency is ignored; compute/step is the median learner's measured step time on "
        "this shared 2-core machine.",
        "- *time waiting*: share of a learner's wall time blocked on the syncer (barriers; decoupled never waits).",
        f"- mixed speeds: learners {cfg['learners'] // 2}..{cfg['learners'] - 1} take {1 + SLOW_FACTOR:g}x the "
        f"measured step time (an added delay) with {SLOW_JITTER:.0%} jitter.",
        "",
    ]
    if result.get("plot"):
        lines += [f"![held-out loss against tokens]({pathlib.Path(result['plot']).name})", ""]
    if result.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in result["notes"]], ""]
    lines.append(results_lib.provenance_markdown(result["provenance"]))
    return "\n".join(lines)


def plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    seed = result["config"]["ablation_seed"]
    ablations = [k for k, r in runs.items() if r["group"] != "mode"]
    fig, axes = plt.subplots(1, 2 if ablations else 1, figsize=(13 if ablations else 7, 4.5), squeeze=False)

    def draw(ax, keys, title):
        for key in keys:
            curve = runs[key]["curve"]
            if curve:
                ax.plot([c["tokens"] / 1e6 for c in curve], [c["heldout_loss"] for c in curve], marker=".", label=key)
        ax.set_xlabel("tokens trained (millions, all learners)")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    draw(axes[0][0], [k for k, r in runs.items() if r["group"] == "mode"], "modes")
    if ablations:
        base = run_key("decoupled", seed)
        draw(axes[0][1], ([base] if base in runs else []) + ablations, f"ablations (seed {seed})")
        axes[0][1].set_ylim(axes[0][0].get_ylim())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
