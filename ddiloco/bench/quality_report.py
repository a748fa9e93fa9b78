"""`ddiloco bench quality`'s summary and report: the targets and the mixed-speed setting the report
states, the mean and spread over seeds (`summarize`), quality.md (`render_markdown`) and quality.png
(`plot`). Split out of ddiloco/bench/quality.py, which runs the configurations and re-exports these."""

from __future__ import annotations

import math
import pathlib

from ddiloco.bench import results as results_lib

# Targets (issue 20): decoupled's held-out loss within 1% of classic DiLoCo's at the same H, at least
# 400x fewer bytes than data-parallel at equal tokens, and at least 95% of the work merged.
TARGET_LOSS_GAP_PCT = 1.0
TARGET_BYTES_RATIO = 400.0
TARGET_WORK_MERGED = 0.95
# Mixed-speed ablations: half the learners this much slower (1.5x the step time), with this much
# jitter on their step time.
SLOW_FACTOR = 0.5
SLOW_JITTER = 0.10


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
    agg = result["summary"]["aggregate"]
    lines = ["# Quality and bandwidth: Decoupled DiLoCo vs classic DiLoCo vs data-parallel", ""]
    lines.append(_setup_text(cfg))
    lines.append("")
    lines += _target_lines(result["summary"].get("targets", {}))
    modes = [n for n in ("dp", "diloco", "decoupled") if n in agg]
    lines += ["## Modes", "", _aggregate_table(agg, modes), ""]
    ablations = [n for n, a in agg.items() if a["group"] != "mode"]
    if ablations:
        lines += [f"## Ablations (decoupled, one change each, seed {cfg['ablation_seed']}; compare with decoupled "
                  "at that seed below)", "", _aggregate_table(agg, ablations), ""]
    lines += ["## Every run", "", _every_run_table(result["runs"]), ""]
    lines += _definition_lines(cfg)
    if result.get("plot"):
        lines += [f"![held-out loss against tokens]({pathlib.Path(result['plot']).name})", ""]
    if result.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in result["notes"]], ""]
    lines.append(results_lib.provenance_markdown(result["provenance"]))
    return "\n".join(lines)


def _setup_text(cfg: dict) -> str:
    """The report's first paragraph: what was run, on what, and how the figures are given."""
    return (
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


def _target_lines(t: dict) -> list[str]:
    """The targets section (empty without targets: no decoupled run)."""
    if not t:
        return []
    lines = ["## Targets"]
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
    return lines


def _aggregate_table(agg: dict, names: list[str]) -> str:
    """Mean ± spread over seeds of each named configuration."""
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


def _every_run_table(runs: dict) -> str:
    """One row per run (configuration and seed), with bytes and the link speed it needs."""
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
    return results_lib.markdown_table(
        ["run", "held-out loss", "vs diloco", "work merged", "contributors/merge (all live)", "bytes", "up", "down",
         "dp / run", "compute/step", "link for 95% CU", "merges", "wall"], rows)


def _definition_lines(cfg: dict) -> list[str]:
    """How each column is computed."""
    return [
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


def plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    from ddiloco import extras

    plt = extras.pyplot()  # the plots extra, Agg backend

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
