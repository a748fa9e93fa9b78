"""`ddiloco bench hostile`: every hostile behaviour of the chaos tool against the shipped defaults.

    ddiloco bench hostile [--steps 100] [--only noise-claims,signflip] [--out bench/results]

Owns the hostile matrix: for each behaviour of `python -m ddiloco.chaos.hostile_learner`
(`CASES`: noise at ~the norm bound with inflated claims, the attack of issue 24; sign flip;
scaled updates within the bound; slow drift; replayed old contributions; a huge claimed batch),
3 honest learners and 1 hostile one train the tiny model as real processes on 127.0.0.1 (the
`LocalCluster` of `ddiloco up`), the syncer with its shipped defaults plus `--merge-ledger`.
Two honest runs calibrate: 3 learners alone (the reference each hostile run is compared with)
and 4 honest learners (whose merge shares and norm ratios are what the defaults must leave
whole). Per run, measured from the ledger and the syncer's state:

* held-out loss of the final global model (evaluator, 4 shards) and its gap to the 3 honest;
* the hostile learner's largest and mean share of a merge's weight; the honest learners' largest;
* merged-norm ratio: per merge, the merged update's norm over the median norm of the honest
  contributions in it (median over merges; ~1 with RDA when nobody dominates);
* honest cosine: per merge, the mean cosine of the honest contributions with the merged update
  (median over merges; on the direction check's sample of coordinates);
* quarantines, of the hostile learner and of honest ones (must be 0), refusals and clips.

Each hostile case passes (`verdict`) when: its held-out loss is at most the 3-honest reference plus
the noise margin; the hostile learner's largest share of a merge where the share cap applies (merges
of `share_cap_min_count` or more, and contributions whose claims were clipped or not yet checkable)
is at most the cap; the audit of the ledger names it; and no honest learner is quarantined or
flagged. The noise margin is calibrated on `--honest-repeats` runs of the 3 honest learners (same
data order: they differ only by timing): the reference is their mean loss and the margin the upper
two-sided 95 % prediction bound of one more such run, t(0.975, R-1) x sd x sqrt(1 + 1/R).

Results: `hostile.json` and `hostile.md` under --out, with provenance (commit, dirty flag).
Short runs on a shared machine (tests/security/test_hostile_run.py measured 2-4 % between honest runs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from ddiloco.cli import service_names
from ddiloco.bench import results as results_lib
from ddiloco.cli import audit as audit_lib
from ddiloco.cli import cluster as cluster_lib

TINY = ["--model-config", json.dumps({"preset": "tiny"}), "--num-fragments", "4", "--sync-period-steps", "4"]
LEARNER_PACE = ["--step-delay-s", "0.03", "--log-every-steps", "50"]
HOSTILE_ID = "learner-3"
# Settings that turn the influence bounds off: the calibration run measures what honest learners
# would do without them (shares before the cap, norms before clipping), which the defaults must allow.
UNBOUNDED = ["--max-merge-share", "1", "--norm-clip-factor", "0", "--unverified-clip-factor", "0"]
# Issue 24's attack: noise of 10x the learner's own pseudo-gradient norm, 4x the steps, a 20x batch.
NOISE_CLAIMS = ["--hostile", "noise:10", "--claim-steps", "4", "--claim-batch", "20"]
# Two-sided 97.5 % quantiles of Student's t by degrees of freedom (the noise margin's); beyond: ~normal.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
CAP_SLACK = 1e-6  # shares are rounded to 6 digits in the ledger
# name -> (hostile_learner flags or None for an honest run, learners, extra syncer flags).
CASES: dict[str, tuple[list[str] | None, int, list[str]]] = {
    "honest3": (None, 3, []),
    "honest4": (None, 4, []),
    "honest4-unbounded": (None, 4, UNBOUNDED),
    "noise-claims": (NOISE_CLAIMS, 4, []),
    # The same attack with the bounds of before issue 24 (no share cap, a batch up to k = 20 x the
    # median, no median-of-norms clipping): what the defaults are measured against.
    "noise-claims-undefended": (NOISE_CLAIMS, 4, ["--max-merge-share", "1", "--max-batch-ratio", "20",
                                                  "--norm-clip-factor", "0", "--unverified-clip-factor", "0"]),
    "signflip": (["--hostile", "signflip"], 4, []),
    "scaled": (["--hostile", "scale:10"], 4, []),
    # The bias is kept out of the hostile learner's own rebase (ddiloco/chaos/hostile_learner.py): before
    # 2026-11-27 it was not, and the bias telescoped away within a few rounds.
    "drift": (["--hostile", "drift:0.5"], 4, []),
    "replay": (["--hostile", "replay"], 4, []),
    "huge-batch": (["--hostile", "honest", "--claim-batch", "1000"], 4, []),
}


def run_case(workdir: pathlib.Path, hostile: Sequence[str] | None, *, learners: int = 4, steps: int = 100,
             syncer_extra: Sequence[str] = (), timeout_s: float = 600.0) -> dict:
    """One run: `learners` learners (the last one hostile with `hostile`'s flags, if given). Returns
    the held-out loss, the syncer's training state (as a dict of what is read here) and the ledger."""
    workdir = pathlib.Path(workdir)
    ledger = workdir / "merges.jsonl"
    cluster = cluster_lib.LocalCluster(workdir)
    try:
        syncer = cluster.start_syncer(run_id="hostile" if hostile else "honest",
                                      extra=[*TINY, "--merge-ledger", str(ledger), *syncer_extra])
        for i in range(learners):
            # A fixed incarnation fixes each learner's data order: every run sees the same batches.
            extra = ["--steps", str(steps), "--num-shards", "4", "--seed", "1", "--incarnation", "1", *LEARNER_PACE]
            if hostile and i == learners - 1:
                cluster.start_learner(i, region=f"region-{i % 2}", extra=[*hostile, *extra],
                                      module="ddiloco.chaos.hostile_learner")
            else:
                cluster.start_learner(i, region=f"region-{i % 2}", extra=extra)
        started = time.monotonic()
        for svc in cluster.learners():
            code = svc.wait(max(1.0, timeout_s - (time.monotonic() - started)))
            if code != 0:
                raise RuntimeError(f"{svc.name} ended with {code}:\n{svc.log_tail()}")
        wall_s = time.monotonic() - started
        out = subprocess.run(
            [sys.executable, "-m", service_names.module("services.learner.evaluator"), "--once",
             "--syncer", syncer.address, "--num-shards", "4", "--log-level", "WARNING", "--timeout-s", "60"],
            capture_output=True, text=True, timeout=180, env=cluster.env, check=True).stdout
        state = _state(syncer.address)
    finally:
        cluster.stop_all(timeout_s=10.0)
    return {"loss": json.loads(out.strip().splitlines()[-1])["heldout_loss"], "wall_s": wall_s, "state": state,
            "ledger": audit_lib.read_ledger(str(ledger)), "ledger_path": str(ledger)}


def _state(address: str) -> dict:
    """What the matrix reads of the syncer's training state: quarantines and refusals per learner."""
    from ddiloco.rpc import channel as channel_lib
    from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

    channel = channel_lib.sync_channel(address)
    try:
        state = syncer_pb2_grpc.SyncerStub(channel).GetTrainingState(
            syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=10).state
    finally:
        channel.close()
    return {"outer_steps": state.outer_steps, "quarantines": state.quarantines, "uploads": dict(state.uploads),
            "members": {m.learner_id: {"quarantined": m.quarantined, "accepted": m.uploads_accepted,
                                       "rejections": {k: v for k, v in m.rejections.items() if v}}
                        for m in state.members}}


def measure(run: dict, hostile_id: str | None) -> dict:
    """The matrix's numbers for one run (see the module docstring). Shares, norm ratios and cosines
    are taken over merges of two or more contributions (alone, a contribution is the merge), and in
    hostile runs over the merges the hostile learner is in."""
    records = run["ledger"]
    shares: dict[str, list[float]] = {}
    uncapped, norm_ratios, honest_cosines, per_step_ratios = [], [], [], []
    for r in records:
        contributors = r["contributors"]
        for c in contributors:
            if c["learner"] != hostile_id and c.get("norm_ratio") is not None:
                per_step_ratios.append(c["norm_ratio"])
        if len(contributors) < 2 or (hostile_id and all(c["learner"] != hostile_id for c in contributors)):
            continue
        honest = [c for c in contributors if c["learner"] != hostile_id]
        for c in contributors:
            shares.setdefault(c["learner"], []).append(c["share"])
            if c["learner"] != hostile_id and c.get("share_uncapped") is not None:
                uncapped.append(c["share_uncapped"])
        norms = [c["norm"] for c in honest if c["norm"]]
        if norms and r.get("merged_norm") is not None:
            norm_ratios.append(r["merged_norm"] / statistics.median(norms))
        cosines = [c["cosine"] for c in honest if c.get("cosine") is not None]
        if cosines:
            honest_cosines.append(statistics.fmean(cosines))
    hostile_shares = shares.get(hostile_id, []) if hostile_id else []
    members = run["state"]["members"]
    return {
        "loss": run["loss"], "merges": len(records), "wall_s": round(run["wall_s"], 1),
        "merges_compared": len(norm_ratios),
        "hostile_max_share": max(hostile_shares, default=0.0),
        **_capped_share(records, hostile_id),
        "hostile_mean_share": statistics.fmean(hostile_shares) if hostile_shares else 0.0,
        "honest_max_share": max((max(v) for k, v in shares.items() if k != hostile_id and v), default=0.0),
        "honest_uncapped_share_p90": _quantile(uncapped, 0.90), "honest_uncapped_share_p99": _quantile(uncapped, 0.99),
        "honest_uncapped_share_max": max(uncapped, default=None),
        "merged_norm_ratio": statistics.median(norm_ratios) if norm_ratios else None,
        "merged_norm_ratio_max": max(norm_ratios, default=None),
        "honest_cosine": statistics.median(honest_cosines) if honest_cosines else None,
        "honest_norm_per_step_ratio_p50": _quantile(per_step_ratios, 0.5),
        "honest_norm_per_step_ratio_p99": _quantile(per_step_ratios, 0.99),
        "honest_norm_per_step_ratio_max": max(per_step_ratios, default=None),
        "hostile_quarantined": bool(hostile_id and members.get(hostile_id, {}).get("quarantined")),
        "honest_quarantined": sum(1 for lid, m in members.items() if lid != hostile_id and m["quarantined"]),
        "hostile_accepted": members.get(hostile_id, {}).get("accepted", 0) if hostile_id else 0,
        "hostile_rejections": members.get(hostile_id, {}).get("rejections", {}) if hostile_id else {},
        "honest_rejections": {lid: m["rejections"] for lid, m in members.items() if lid != hostile_id and m["rejections"]},
        "honest_clipped": _clipped(records, hostile_id),
        "audit_flags": {lid: e["flags"] for lid, e in audit_lib.influence(records).items() if e["flags"]},
        # Per learner, the audit's persistent-residual score (a bias kept up across rounds; None: too few rounds).
        "residual_persistent": {lid: round(v, 4) for lid, v in sorted(audit_lib.persistent_scores(records).items())},
    }


def _capped_share(records: list[dict], hostile_id: str | None) -> dict:
    """The hostile learner's largest share where the share cap applies (ddiloco.algo.merge: merges of
    `share_cap_min_count` or more, and contributions whose claims were clipped or not yet checkable,
    in merges of two or more), and the largest cap those merges had."""
    shares, caps = [], []
    for r in records:
        inputs = r.get("merge_inputs") or {}
        for c in r["contributors"]:
            if c["learner"] != hostile_id:
                continue
            # Alone, a contribution is the merge (share 1): no cap can apply.
            if len(r["contributors"]) >= 2 and (len(r["contributors"]) >= inputs.get("share_cap_min_count", 1)
                                                or (c.get("fold") or {}).get("claims_unverified")):
                shares.append(c["share"])
                caps.append(inputs.get("max_share", 1.0))
    return {"hostile_max_share_capped": max(shares, default=0.0), "share_cap": max(caps, default=None),
            "hostile_capped_merges": len(shares)}


def verdict(case: dict, reference: dict, hostile_id: str = HOSTILE_ID) -> dict:
    """Whether a hostile case passes (see the module docstring), criterion by criterion."""
    margin = reference.get("margin")
    loss_ok = None if margin is None else case["loss"] <= reference["mean"] + margin
    cap = case.get("share_cap")
    share_ok = cap is None or case["hostile_max_share_capped"] <= cap + CAP_SLACK
    named = hostile_id in case["audit_flags"]
    honest_ok = case["honest_quarantined"] == 0 and not any(lid != hostile_id for lid in case["audit_flags"])
    return {"loss_within_margin": loss_ok, "share_under_cap": share_ok, "named": named, "honest_untouched": honest_ok,
            "pass": bool(loss_ok and share_ok and named and honest_ok)}


def noise_reference(losses: Sequence[float]) -> dict:
    """The 3-honest reference: mean loss over the repeats and the margin one more honest run stays
    within (two-sided 95 % prediction interval's upper half-width); no margin with fewer than 2."""
    mean = statistics.fmean(losses) if losses else None
    if len(losses) < 2:
        return {"losses": list(losses), "mean": mean, "sd": None, "margin": None}
    sd = statistics.stdev(losses)
    t = T_975.get(len(losses) - 1, 1.96)
    return {"losses": list(losses), "mean": mean, "sd": sd, "margin": t * sd * (1 + 1 / len(losses)) ** 0.5}


def _clipped(records: list[dict], hostile_id: str | None) -> dict[str, int]:
    """How often honest contributions were clipped, by what (steps: a correction, not a penalty)."""
    counts: dict[str, int] = {}
    for r in records:
        for c in r["contributors"]:
            if c["learner"] != hostile_id:
                for what in c.get("clipped", ()):
                    counts[what] = counts.get(what, 0) + 1
    counts["contributions"] = sum(1 for r in records for c in r["contributors"] if c["learner"] != hostile_id)
    return counts


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "NO"


def render_markdown(result: dict) -> str:
    rows = []
    reference = result.get("reference") or {}
    base = reference.get("mean") or result["cases"].get("honest3", {}).get("loss")
    for name, m in result["cases"].items():
        gap = f"{m['loss'] / base - 1:+.1%}" if base else "-"
        flagged = ", ".join(sorted(m["audit_flags"])) or "-"
        v = m.get("verdict") or {}
        rows.append([name, m["loss"], gap, m["hostile_max_share"], m.get("hostile_max_share_capped", "-"),
                     m["honest_max_share"],
                     "-" if m["merged_norm_ratio"] is None else m["merged_norm_ratio"],
                     "-" if m["honest_cosine"] is None else m["honest_cosine"],
                     "yes" if m["hostile_quarantined"] else "no", m["honest_quarantined"], m["hostile_accepted"],
                     flagged, _yes(v.get("loss_within_margin")), _yes(v.get("share_under_cap")),
                     _yes(v.get("named")), _yes(v.get("honest_untouched")),
                     "-" if not v else "PASS" if v["pass"] else "FAIL"])
    table = results_lib.markdown_table(
        ["case", "held-out loss", "vs 3 honest", "hostile max share", "hostile max share where capped",
         "honest max share", "merged norm / honest", "honest cos with merged", "hostile quarantined",
         "honest quarantined", "hostile accepted", "audit flags", "loss within margin", "share under cap",
         "ledger names it", "no honest flagged or quarantined", "verdict"],
        rows)
    margin = reference.get("margin")
    noise = ("Noise margin: not calibrated (fewer than 2 runs of the 3 honest learners)." if margin is None else
             f"Noise margin, from {len(reference['losses'])} runs of the 3 honest learners (losses "
             f"{', '.join(f'{x:.4f}' for x in reference['losses'])}: mean {reference['mean']:.4f}, sd "
             f"{reference['sd']:.4f}): a hostile case passes on loss at most {reference['mean'] + margin:.4f} "
             f"(mean + {margin:.4f}, {margin / reference['mean']:+.1%}; the upper bound of a two-sided 95 % prediction "
             "interval for one more honest run). Gaps are to that mean.")
    calibration = result["cases"].get("honest4-unbounded", {})
    honest = result["cases"].get("honest4", {})
    clipped = honest.get("honest_clipped", {})
    return (
        "# Hostile matrix (`ddiloco bench hostile`)\n\n"
        f"3 honest learners + 1 hostile (`{HOSTILE_ID}`, `python -m ddiloco.chaos.hostile_learner`), tiny model, "
        f"{result['steps']} inner steps each, shipped syncer defaults plus `--merge-ledger` (except the cases "
        "named unbounded or undefended, whose flags are in hostile.json); one seed, real processes on one shared "
        "machine. Shares, norms and cosines are read from the merge ledger over the merges of two or more "
        "contributions that include the hostile learner (all such merges in honest runs); definitions in "
        "ddiloco/bench/hostile.py. The share cap applies in merges of three or more and to contributions "
        "whose claims were clipped or not yet checkable: `hostile max share where capped` is the share the "
        "verdict compares with the cap.\n\n"
        + table + "\n\n" + noise + "\n\n"
        "Calibration of the defaults (`honest4-unbounded`: 4 honest learners, no share cap, no norm clipping): "
        f"honest per-step norm over the other learners' median: median {calibration.get('honest_norm_per_step_ratio_p50')}, "
        f"p99 {calibration.get('honest_norm_per_step_ratio_p99')}, max {calibration.get('honest_norm_per_step_ratio_max')} "
        + ("(the default `--norm-clip-factor` 4 is above every one of them); "
           if (calibration.get("honest_norm_per_step_ratio_max") or 0) < 4 else
           "(some are above the default `--norm-clip-factor` 4: honest contributions were clipped); ")
        + 
        f"honest share of a merge without the cap: p90 {calibration.get('honest_uncapped_share_p90')}, "
        f"p99 {calibration.get('honest_uncapped_share_p99')}, max {calibration.get('honest_uncapped_share_max')}. "
        f"With the defaults (`honest4`), of {clipped.get('contributions', 0)} honest contributions "
        f"{clipped.get('share', 0)} were lowered by the share cap (in merges of two, where the cap makes both "
        f"weigh the same), {clipped.get('norm', 0) + clipped.get('norm_in_merge', 0)} clipped in norm and "
        f"{clipped.get('batch', 0)} in batch; held-out loss {honest.get('loss')} against "
        f"{calibration.get('loss')} without the bounds.\n\n"
        + results_lib.provenance_markdown(result["provenance"])
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=100, help="inner steps per learner")
    parser.add_argument("--honest-repeats", type=int, default=3,
                        help="runs of the 3 honest learners that calibrate the noise margin (with honest3 selected)")
    parser.add_argument("--only", default="", help=f"comma-separated cases (default all: {', '.join(CASES)})")
    parser.add_argument("--workdir", default="", help="where the runs' logs and ledgers go (default: a temp dir)")
    parser.add_argument("--out", default=str(results_lib.DEFAULT_OUT_DIR))


def run(args: argparse.Namespace) -> int:
    import tempfile

    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"ddiloco bench hostile: unknown cases {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    if "honest3" in names:  # the noise calibration: the 3 honest learners again, right after the first
        at = names.index("honest3") + 1
        names[at:at] = [f"honest3-{i}" for i in range(2, args.honest_repeats + 1)]
    prov = results_lib.provenance()
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="ddiloco-hostile-"))
    result = {"benchmark": "hostile", "steps": args.steps, "provenance": prov, "cases": {}}
    for name in names:
        hostile, learners, syncer_extra = CASES["honest3" if name.startswith("honest3-") else name]
        print(f"[hostile] {name} ...", flush=True)
        run_ = run_case(workdir / name, hostile, learners=learners, steps=args.steps, syncer_extra=syncer_extra)
        result["cases"][name] = {"flags": hostile, "syncer_flags": syncer_extra,
                                 **measure(run_, HOSTILE_ID if hostile else None)}
        print(f"[hostile] {name}: {json.dumps(result['cases'][name])}", flush=True)
    judge(result)
    json_path, md_path = results_lib.write_result(pathlib.Path(args.out), "hostile", result, render_markdown(result))
    print(f"wrote {json_path} and {md_path}")
    return 0


def judge(result: dict) -> None:
    """Adds the 3-honest reference (`result["reference"]`) and each hostile case's verdict."""
    cases = result["cases"]
    reference = noise_reference([m["loss"] for n, m in cases.items() if n == "honest3" or n.startswith("honest3-")])
    result["reference"] = reference
    for m in cases.values():
        if m["flags"]:
            m["verdict"] = verdict(m, reference)
