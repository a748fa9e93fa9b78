"""The report of `ddiloco bench perf`: the headline figures (each a value, the limit measured
beside it, their ratio and the target it is held to) and perf.md, section by section.
"""

from __future__ import annotations

from ddiloco.bench import perf_upload
from ddiloco.bench import results as results_lib
from ddiloco.bench.perf_micro import UPLOAD_PATH

TARGETS = {
    "codec_int4_encode": 0.25,
    "merge": 0.30,
    "transport": 0.70,
    "overlap_max_share": 0.02,
    "shard_speedup": 1.7,  # merges/s of 2 shards over 1 at saturation (issue 21)
    "work_merged": 0.99,  # merged over offered learner-steps at 64 learners, the end included (_work_cell)
}


def figure(name: str, value: float, unit: str, limit: float, limit_name: str, target: float | None = None,
           higher_is_better: bool = True, **extra) -> dict:
    """One headline row: `value` as a ratio of `limit`, marked against `target` if given."""
    ratio = value / limit if limit > 0 else 0.0
    out = {"name": name, "value": value, "unit": unit, "limit": limit, "limit_name": limit_name, "ratio": ratio}
    if target is not None:
        out["target"] = target
        out["meets_target"] = bool(ratio >= target) if higher_is_better else bool(ratio <= target)
    out.update(extra)
    return out


def headline(result: dict) -> list[dict]:
    """The figures perf.md opens with, each against its limit and, where one is set, its target."""
    rows = []
    micro = result.get("micro", {}).get("sizes", {})
    for label in ("default", "large"):
        if label not in micro:
            continue
        m = micro[label]
        where = f"{m['numel']:,} values ({label})"
        for codec in ("int4", "int8"):
            c = m["codec"][codec]
            for side, key in (("host codec (learner uploads, syncer)", "numpy"), ("JAX jitted (device values)", "jax")):
                for op in ("encode", "decode"):
                    rows.append(figure(f"{codec} {op}, {side}, {where}", c[f"{key}_{op}"], "GB/s fp32", c["memcpy_gbps"],
                                       "memcpy (1 core)", TARGETS["codec_int4_encode"] if (codec, op) == ("int4", "encode") else None))
        mg = m["merge"]
        rows.append(figure(f"merge fold-in, {where}", mg["fold_in"], "GB/s params", mg["memcpy_gbps"], "memcpy (1 core)", TARGETS["merge"]))
        rows.append(figure(f"outer step (result + Nesterov), {where}", mg["outer_step"], "GB/s params", mg["memcpy_gbps"],
                           "memcpy (1 core)", TARGETS["merge"]))
    for key in ("transport", "transport_large"):
        t = result.get(key)
        if t:
            rows.append(figure(f"upload through the servicer, {t['params']:,}-param model", t["servicer_bytes_per_s"] / 1e6, "MB/s wire",
                               t["bare_bytes_per_s"] / 1e6, "bare gRPC stream", TARGETS["transport"]))
            if t.get("servicer_concurrent_bytes_per_s"):
                rows.append(figure(f"upload through the servicer, {t['in_flight']} in flight, {t['params']:,}-param model",
                                   t["servicer_concurrent_bytes_per_s"] / 1e6, "MB/s wire",
                                   t["bare_concurrent_bytes_per_s"] / 1e6, f"bare gRPC stream, {t['in_flight']} in flight",
                                   TARGETS["transport"]))
            if t.get("servicer_fp32_bytes_per_s"):
                rows.append(figure(f"upload through the servicer, fp32 uploads, {t['params']:,}-param model",
                                   t["servicer_fp32_bytes_per_s"] / 1e6, "MB/s wire", t["bare_bytes_per_s"] / 1e6,
                                   "bare gRPC stream"))
    for sec in result.get("upload", []):
        for c in sec["cells"]:
            rows.append(figure(f"upload, learner's real client through the syncer, {sec['params']:,}-param model, "
                               f"+{c['rtt_s'] * 1e3:.0f} ms RTT", c["real_bytes_per_s"] / 1e6, "MB/s wire",
                               c["bare_bytes_per_s"] / 1e6, "bare gRPC stream, same bytes", TARGETS["transport"]))
    rows += _scale_headline(result.get("scale"), result.get("saturation"))
    ov = result.get("overlap")
    if ov:
        for key in ("default", "capped"):
            if key in ov:
                rows.append(figure(f"learner time in communication work ({key})", ov[key]["comm_share"], "share of wall",
                                   1.0, "wall time", TARGETS["overlap_max_share"], higher_is_better=False))
    return rows


def _scale_headline(sc: dict | None, sat: dict | None = None) -> list[dict]:
    """Scale-out: N shards' merges/s against one shard's, at saturation (`sat`, the saturation
    levels: the target) and at the default schedule's most learners (no target: merges/s there is
    the schedule's rate); the share of the offered work merged at the most learners."""
    rows = []
    if sat and sat.get("levels"):
        size = f", {sat['params'] / 1e6:.0f}M-param model" if sat.get("params") else ""
        where = f"saturation ({sat['learners']} replay learners, step {sat['step_s'] * 1e3:.0f} ms{size})"
        for sp in sat.get("speedups", []):
            rows.append(figure(f"merges/s, {sp['shards']} syncer shards, {where}", sp["merges_per_s"], "merges/s",
                               sp["one_shard_merges_per_s"], "one shard, same load",
                               TARGETS["shard_speedup"] if sp["shards"] == 2 else None))
            if "uploads_accepted_per_s" in sp:
                rows.append(figure(f"uploads accepted/s, {sp['shards']} syncer shards, {where}",
                                   sp["uploads_accepted_per_s"], "uploads/s", sp["one_shard_uploads_accepted_per_s"],
                                   "one shard, same load"))
    if not sc or not sc.get("levels"):
        return rows
    most = max(lv["learners"] for lv in sc["levels"])
    for sp in sc.get("speedups", []):
        if sp["learners"] == most:
            rows.append(figure(f"merges/s, {sp['shards']} syncer shards, {most} replay learners, default schedule",
                               sp["merges_per_s"], "merges/s", sp["one_shard_merges_per_s"], "one shard, same learners",
                               None if sat else TARGETS["shard_speedup"] if sp["shards"] == 2 else None))
            rows.append(figure(f"uploads accepted, {sp['shards']} syncer shards, {most} replay learners",
                               sp["uploads_accepted"], "uploads", sp["one_shard_uploads_accepted"],
                               "one shard, same learners, same run length"))
    for lv in sc["levels"]:
        if lv["learners"] == most and lv.get("offered_steps"):
            rows.append(figure(f"work merged, {most} replay learners, {lv.get('shards', 1)} shard(s)",
                               merged_steps(lv), "learner-steps", lv["offered_steps"],
                               "trained (offered), whole run, finish included" if "merged_steps" in lv
                               else "offered by the schedule", TARGETS["work_merged"]))
    return rows


def _md_intro(result: dict) -> list[str]:
    """The title, how to read the figures, the machine's load and the headline table."""
    md = ["# Performance: syncer, codec and transport against this machine's limits", ""]
    md.append("Each figure is a ratio to a limit measured in the same invocation on the same working set "
              "(see `ddiloco/bench/perf.py`). The machine is a shared 2-core VM: other processes compete for the "
              "cores, so absolute numbers move between runs; ratios are measured interleaved, best of several repeats.")
    load = result.get("load_average_start"), result.get("load_average_end")
    if all(load):
        md.append("")
        md.append(f"Load average (1 min) on the 2 cores: {load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end "
                  "(other work was running on the machine).")
    md.append("")
    md.append("## Headline")
    rows = []
    for f in result["headline"]:
        target = ""
        if "target" in f:
            sign = ">=" if f["name"].find("communication") < 0 else "<"
            target = f"{sign} {f['target']:.0%}: {'yes' if f['meets_target'] else 'NO'}"
        rows.append([f["name"], f"{f['value']:.3g} {f['unit']}", f"{f['limit']:.3g} ({f['limit_name']})",
                     f"{f['ratio']:.1%}", target])
    md.append(results_lib.markdown_table(["figure", "value", "limit", "ratio", "target"], rows))
    return md


def _md_micro(label: str, m: dict) -> list[str]:
    """Codec, zstd, merge and the syncer's per-upload work at one fragment size."""
    md = ["", f"## Codec and merge, {m['numel']:,} values ({label}), one core", ""]
    rows = []
    for codec, c in m["codec"].items():
        rows.append([codec] + [f"{c[k]:.2f} ({c[k] / c['memcpy_gbps']:.0%})" for k in
                               ("numpy_encode", "numpy_decode", "jax_encode", "jax_decode")] + [f"{c['memcpy_gbps']:.2f}"])
    md.append(results_lib.markdown_table(
        ["codec", "host encode GB/s", "host decode", "JAX encode", "JAX decode", "memcpy GB/s"], rows))
    md.append("")
    rows = [[k, f"{z['ratio']:.3f}", f"{z['compress_gbps_raw']:.2f}", f"{z['decompress_gbps_raw']:.2f}",
             f"{z['sha256_gbps']:.2f}", "yes" if z["real_pseudo_gradients"] else "no (synthetic)"]
            for k, z in m["zstd"].items()]
    md.append(results_lib.markdown_table(["zstd-3 on", "ratio", "compress GB/s (raw)", "decompress GB/s (raw)",
                                          "sha256 GB/s", "captured pseudo-gradients"], rows))
    md.append("")
    mg = m["merge"]
    md.append(results_lib.markdown_table(
        ["merge", "GB/s params", "of memcpy"],
        [[k, f"{mg[k]:.2f}", f"{mg[k] / mg['memcpy_gbps']:.0%}"] for k in ("fold_in", "fold_in_own_norms", "outer_step", "result_only", "stepper_only")
         if k in mg]))
    bound = mg.get("outer_step_traffic_bound")
    if bound:
        md.append(f"\nThe outer step reads three vectors and writes two (the delta stays factored); a memcpy of "
                  f"three vectors (the step's working set, {3 * m['numel'] * 4 / 2**20:.1f} MiB, six streams) in "
                  f"the same run bounds its five streams at {bound:.2f} GB/s "
                  f"of params, {bound / mg['memcpy_gbps']:.0%} of the one-vector memcpy above. The step runs at "
                  f"{mg['outer_step'] / bound:.0%} of that bound.")
    up = m.get("upload_path")
    if up:
        md.append("")
        stages = [k for k in up if k not in ("memcpy", "memcpy_gbps")]
        # The per-upload path, as the syncer runs it; other rows are its parts or once-per-version work.
        path = [k for k in UPLOAD_PATH if k in up] or stages
        total_s = sum(1.0 / up[k] for k in path)
        md.append(results_lib.markdown_table(
            ["syncer work per int4 upload", "GB/s fp32", "of memcpy", "share of the upload's CPU time"],
            [[k, f"{up[k]:.2f}", f"{up[k] / up['memcpy_gbps']:.0%}", f"{(1.0 / up[k]) / total_s:.0%}" if k in path else "-"]
             for k in stages]
            + [["per upload (" + " + ".join(path) + ")", f"{1.0 / total_s:.2f}",
                f"{(1.0 / total_s) / up['memcpy_gbps']:.0%}", "100%"]]))
    return md


def _md_transport(key: str, t: dict) -> list[str]:
    """The servicer against the bare stream at one model size, and the ceiling."""
    md = ["", "No merge runs while uploads are measured (a quorum no round reaches), so the figure is the "
              "servicer's upload path: header checks, chunk assembly, sha256, zstd, dequantize, norm bound, "
              "fold-in. Every int4 byte on the wire is ~7.5 bytes of float32 the syncer must process: at the "
              "upload path's measured speed (table above, 'per upload') that caps int4 uploads "
              "well below a bare stream on the same cores; fp32 uploads show the transport overhead itself."] \
        if key == "transport" else []
    md += ["", f"## Transport ({t['params']:,}-parameter model, fragments of {max(t['fragment_numels']):,} values, int4)", ""]
    md.append(results_lib.markdown_table(
        ["path", "MB/s wire", "ratio"],
        [["real servicer, int4 uploads (checks, decode, norm bound, fold-in)",
          f"{t['servicer_bytes_per_s'] / 1e6:.1f}", f"{t['ratio']:.1%}"],
         ["real servicer, fp32 uploads (same work per value, 7.5x the bytes)",
          f"{t.get('servicer_fp32_bytes_per_s', 0) / 1e6:.1f}", f"{t.get('ratio_fp32', 0):.1%}"],
         ["bare gRPC bytes stream", f"{t['bare_bytes_per_s'] / 1e6:.1f}", "100%"]]
        + ([[f"real servicer, int4 uploads, {t['in_flight']} in flight (one per fragment, as a learner sends them)",
             f"{t['servicer_concurrent_bytes_per_s'] / 1e6:.1f}", f"{t['ratio_concurrent']:.1%}"],
            [f"bare gRPC bytes stream, {t['in_flight']} in flight", f"{t['bare_concurrent_bytes_per_s'] / 1e6:.1f}",
             "100%"]] if t.get("servicer_concurrent_bytes_per_s") else [])))
    md.append(f"\nUploads accepted/refused: {t['servicer_run'].get('accepted')}/{t['servicer_run'].get('refused')}; "
              f"syncer peak RSS {t['syncer_peak_rss_bytes'] / 2**20:.0f} MiB.")
    if t.get("work_s_per_upload"):
        md.append(
            f"\nCeiling, measured in the same run: one upload of the largest fragment is "
            f"{t['upload_bytes'] / 1e6:.2f} MB on the wire, {t['bare_s_per_upload'] * 1e3:.2f} ms on the bare "
            f"stream; the syncer's own work on it (decode with norms and cosine, then fold-in, one thread, "
            f"this process) takes {t['work_s_per_upload'] * 1e3:.2f} ms, and the real servicer "
            f"{t['servicer_s_per_upload'] * 1e3:.2f} ms per upload. A servicer that added nothing but that "
            f"work to a bare stream would reach {t['ceiling_serial']:.1%} of it doing the work after the "
            f"transfer and {t['ceiling_overlapped']:.1%} overlapping the two perfectly; the measured "
            f"{t['ratio']:.1%} is {t['ratio'] / t['ceiling_serial']:.0%} of the serial ceiling.")
    return md


def _md_overlap(ov: dict) -> list[str]:
    """The learner's communication share in each run, and the bandwidth the configuration needs."""
    md = ["", "## Learner overlap", "", ov["definition"], ""]
    rows = []
    for key in ("null", "default", "capped"):
        if key in ov:
            r = ov[key]
            rows.append([key, f"{r['step_s'] * 1e3:.0f}", f"{r['comm_share']:.2%}",
                         ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["by_part_s"].items()),
                         r["client"].get("uploads_accepted", 0), r["fragments_applied"],
                         f"{r['training_thread_cpu_per_step_s'] * 1e3:.0f} / {r['other_threads_cpu_per_step_s'] * 1e3:.0f}"
                         f" / {r['syncer_cpu_per_step_s'] * 1e3:.0f}"])
    md.append(results_lib.markdown_table(["run", "ms/step", "comm share", "where", "uploads accepted",
                                          "fragments applied",
                                          "CPU ms/step: Python training thread / other learner threads (XLA compute, sync client, codec) / syncer"], rows))
    need = ov["needed_bandwidth"]
    md.append(f"\nThe configuration needs {need['up_bytes_per_s'] / 1e3:.0f} kB/s up and "
              f"{need['down_bytes_per_s'] / 1e3:.0f} kB/s down at the measured step time; the capped run goes through "
              f"a proxy limited to {ov.get('capped', {}).get('cap_bytes_per_s', 0) / 1e3:.0f} kB/s per direction. "
              f"Step-time cost against a learner that never hears from the syncer (the faster of two such runs, "
              f"before and after): {ov['throughput_cost']:.1%}. The training thread itself spends the 'comm share' "
              "above on communication. The rest is CPU taken from the same 2 cores: the learner's sync client "
              "and codec (the growth of 'other learner threads' over the null run, whose other threads are XLA's "
              "compute), the syncer process (last figure), and the machine's other load, which changes between "
              "runs.")
    return md


def _mib(values) -> str:
    """Bytes as MiB, one figure per shard ("a + b")."""
    return " + ".join(f"{v / 2**20:.0f}" for v in values)


def _peaks(lv: dict) -> list[int]:
    """Each shard's peak RSS (a run from before shards: its one syncer's)."""
    return lv["shard_peak_rss_bytes"] if "shard_peak_rss_bytes" in lv else [lv["syncer_peak_rss_bytes"]]


def _shard_rss(lv: dict) -> str:
    before = (lv["shard_rss_before_learners_bytes"] if "shard_rss_before_learners_bytes" in lv
              else [lv["syncer_rss_before_learners_bytes"]])
    return f"{_mib(before)} / {_mib(_peaks(lv))}"


def _rss_growth(levels: list[dict]) -> list[str]:
    """Each shard's peak RSS at the fewest and the most learners, per shard count (flat is the target)."""
    md = []
    for shards in sorted({lv.get("shards", 1) for lv in levels}):
        mine = [lv for lv in levels if lv.get("shards", 1) == shards]
        low, high = min(mine, key=lambda lv: lv["learners"]), max(mine, key=lambda lv: lv["learners"])
        if low is not high:
            peak = [_peaks(lv) for lv in (low, high)]
            md.append(f"\nPeak RSS per shard, {shards} shard(s): {_mib(peak[0])} MiB at {low['learners']} learners, "
                      f"{_mib(peak[1])} MiB at {high['learners']}.")
    return md


def _md_scale(sc: dict) -> list[str]:
    """One row per learner count and shard count, the speed-up of shards, and how to read them."""
    md = ["", f"## Scale: syncer shards, lightweight learners replaying captured fragments "
              f"(step {sc['step_s']:.2f} s, default fragment schedule)", ""]
    md.append(results_lib.markdown_table(
        ["learners", "shards", "merges/s (by shard)",
         "work merged (steps merged/trained; accepted; uploads slowed by back-pressure; at the end pending, "
         "unmerged, lost; the shards' count)" if any("merged_steps" in lv for lv in sc["levels"]) else
         "work merged (steps accepted/trained; uploads slowed by back-pressure; steps pending at the end, lost)",
         "merge latency p50/p99 s", "upload latency p50/p99 s",
         "uploads acc/ref (offered)", "syncer RSS MiB before learners / peak, per shard"],
        [[lv["learners"], lv.get("shards", 1),
          f"{lv['merges_per_s']:.2f}" + (" (" + " + ".join(f"{m:.2f}" for m in lv["merges_per_s_by_shard"]) + ")"
                                         if len(lv.get("merges_per_s_by_shard", [])) > 1 else ""),
          _work_cell(lv), f"{lv['merge_latency_p50_s']:.3f} / {lv['merge_latency_p99_s']:.3f}",
          f"{lv['upload_latency_p50_s']:.3f} / {lv['upload_latency_p99_s']:.3f}",
          f"{lv['uploads_accepted']}/{lv['uploads_refused']}"
          + (f" ({lv['uploads_offered']})" if "uploads_offered" in lv else "")
          + (" " + ", ".join(f"{k} {v}" for k, v in lv.get("refusals", {}).items()) if lv.get("refusals") else "")
          + ("; " + ", ".join(f"{k[len('rejected_'):]} {v}" for k, v in sorted(lv.get("syncer_uploads", {}).items())
                              if k.startswith("rejected_")) if lv.get("refusals") else ""),
          _shard_rss(lv)]
         for lv in sc["levels"]]))
    md += _rss_growth(sc["levels"])
    if any("merged_steps" in lv for lv in sc["levels"]):
        md += _item3(sc["levels"]) + ["\n" + WORK_MERGED_DEFINITION]
    for sp in sc.get("speedups", []):
        md.append(f"\n{sp['shards']} shards against one at {sp['learners']} learners: {sp['merges_per_s']:.2f} / "
                  f"{sp['one_shard_merges_per_s']:.2f} merges/s = {sp['ratio']:.2f}x (target at saturation, the "
                  f"most learners: >= {TARGETS['shard_speedup']:.1f}x for 2 shards); uploads accepted (contributions "
                  f"folded in, same run length) {sp.get('uploads_accepted', 0)} / "
                  f"{sp.get('one_shard_uploads_accepted', 0)} = {sp.get('uploads_ratio', 0.0):.2f}x.")
    if sc.get("levels"):
        cap = 4 / (8 * sc["step_s"])
        md.append(f"\nMerges/s cannot exceed the fragment schedule's rate, P / (H x step) = 4 / (8 x "
                  f"{sc['step_s']:.2f} s) = {cap:.2f}/s, once every round merges on time: beyond that, shards "
                  "show as uploads accepted (fewer periods merged together by back-pressure), not as merges. "
                  "The scale-out target is held to the saturation levels (their own section).")
    md.append("\nMerge latency: round opened to merge started (quorum wait + grace used), from the syncer's merge "
              "records; upload latency: client-side UploadFragment round trip (decode and fold-in included). "
              "Uploads offered: what the fragment schedule asks of the replay learners in the run; refusals "
              "by status code, then by the syncer's reason. The replay learners report progress at the real "
              "client's interval, with their step time (the grace window is computed from it), and upload on the version "
              "they last heard of; they share the 2 cores with the syncer. Peak RSS: the merge state is one "
              "accumulator per fragment whatever the number of learners; per learner the syncer holds one "
              "download chunk (at most 128 KiB, the messages of a version built once for all watchers) and "
              "at most 3 x P decoded contributions wait for a fragment's lock; the direction check keeps "
              "16 references per fragment; malloc arenas are capped at 2 (per-thread arenas kept ~100 MiB "
              "of freed buffers at 64 learners) and BLAS calls run single-threaded (ddiloco.runtime).")
    return md


def merged_steps(lv: dict) -> int:
    """A level's work merged, in learner-steps: what the replay learners saw merged by the end of
    their finish ("merged_steps"); a run from before the finish (s34 and earlier) had only what the
    shards accepted and merged, the smaller of the two."""
    if "merged_steps" in lv:
        return lv["merged_steps"]
    return min(lv.get("accepted_steps", 0), lv.get("merged_steps_syncer", lv.get("accepted_steps", 0)))


WORK_MERGED_DEFINITION = (
    "Work merged: learner-steps (summed over the P fragments: every step is one step of work on every "
    "fragment) in contributions the replay learner saw merged into the global model (the fragment's owner "
    "published a version after the one the contribution was accepted on, and the watch delivered it), over "
    "the whole run, divided by the learner-steps trained (offered), the end included: at the end of its "
    "steps each replay learner finishes as a real one does (reports finished, contributes all remaining work "
    "as final uploads, the steps since each fragment's last turn too, and waits at most the real learner's "
    "finish timeout for it to merge). Back-pressure merges several periods into one contribution and loses "
    "nothing. What is outside the global model after the finish is counted where it is: pending (never "
    "accepted), unmerged (accepted, its round not merged), lost (in none: 0 by construction). The shards' own "
    "count (tokens_merged / tokens per step, read after every learner finished) is the cross-check.")


def _work_cell(lv: dict) -> str:
    """Work merged of work trained, and where the rest is at the end (WORK_MERGED_DEFINITION); a run
    from before the finish: accepted of offered, pending and lost, as it was reported."""
    offered = lv.get("offered_steps", 0)
    if "merged_steps" in lv:
        merged = lv["merged_steps"]
        cell = (f"{merged / max(1, offered):.1%} ({merged}/{offered}; {lv.get('accepted_steps', 0)} accepted; "
                f"{lv.get('slowed', 0)} slowed; at the end {lv.get('pending_steps_end', 0)} pending, "
                f"{lv.get('unmerged_steps_end', 0)} unmerged, {lv.get('lost_steps', 0)} lost")
    else:
        accepted = lv.get("accepted_steps", 0)
        cell = f"{accepted / max(1, offered):.1%} ({accepted}/{offered}; {lv.get('slowed', 0)} slowed"
        if "lost_steps" in lv:
            cell += f"; {lv.get('pending_steps_end', 0)} pending, {lv['lost_steps']} lost"
    if "merged_steps_syncer" in lv:
        cell += f"; the shards merged {lv['merged_steps_syncer']}"
    return cell + ")"


def _item3(levels: list[dict]) -> list[str]:
    """Issue 21 item 3 in one place, per shard count: work merged at the most learners, merge
    latency p50/p99 and each shard's peak RSS at the fewest and the most learners."""
    md = []
    for shards in sorted({lv.get("shards", 1) for lv in levels}):
        mine = sorted((lv for lv in levels if lv.get("shards", 1) == shards), key=lambda lv: lv["learners"])
        ends = mine[:1] + mine[-1:] if len(mine) > 1 else mine
        share = merged_steps(ends[-1]) / max(1, ends[-1].get("offered_steps", 0))
        latency = "; ".join(f"{lv['merge_latency_p50_s']:.3f} / {lv['merge_latency_p99_s']:.3f} s at "
                            f"{lv['learners']} learners" for lv in ends)
        rss = "; ".join(f"{_mib(_peaks(lv))} MiB at {lv['learners']} learners" for lv in ends
                        if "shard_peak_rss_bytes" in lv or "syncer_peak_rss_bytes" in lv)
        md.append(f"\nDefault schedule, {shards} shard(s): work merged at {ends[-1]['learners']} learners {share:.1%} "
                  f"(target >= {TARGETS['work_merged']:.0%}); merge latency p50/p99 {latency}; "
                  f"peak RSS per shard {rss or 'not measured'}.")
    return md


def _cores(values) -> str:
    return " + ".join(f"{v:.2f}" for v in values)


def md_saturation(sat: dict) -> list[str]:
    """The saturation levels: each shard count under the same load, what the schedule offered,
    what the shards served, every process's CPU and whether the level was saturated."""
    model = (f", synthetic {sat['params'] / 1e6:.1f}M-parameter model (fragments of "
             f"{'/'.join(f'{n / 1e6:.2f}M' for n in sat['fragment_numels'])} values)" if sat.get("params") else "")
    md = ["", f"## Scale-out at saturation: {sat['learners']} replay learners, step {sat['step_s'] * 1e3:.0f} ms{model}",
          "", f"The schedule offers {sat['offered_rounds_per_s']:.1f} rounds/s (P / (H x step)) and "
              f"{sat['offered_uploads_per_s']:.0f} uploads/s (one per learner per round); a level is saturated "
              "when its merges/s fall more than 10 % short of the rounds offered and the shards' back-pressure "
              "gauge is engaged (accepted uploads slowed). CPU in cores over the measurement window "
              f"({sat.get('cores', 2)} cores on the machine).", ""]
    md.append(results_lib.markdown_table(
        ["shards", "merges/s (by shard)", "uploads accepted/s", "slowed share (max factor)",
         "shard CPU, cores (same learners, no uploads)", "replay CPU, cores", "shard CPU-s per merge / per upload", "saturated", "work merged"],
        [[lv["shards"], f"{lv['merges_per_s']:.2f}" + (" (" + _cores(lv["merges_per_s_by_shard"]) + ")"
                                                       if lv["shards"] > 1 else ""),
          f"{lv['uploads_accepted_per_s']:.1f}", f"{lv['slowed_share']:.0%} ({lv.get('hint_factor_max', 1.0):.1f}x)",
          _cores(lv.get("shard_cpu_share_by_shard", []))
          + (f" ({_cores(lv['idle_shard_cpu_share_by_shard'])})" if lv.get("idle_shard_cpu_share_by_shard") else ""),
          f"{lv.get('replay_cpu_share', 0.0):.2f}",
          f"{lv.get('shard_cpu_s_per_merge', 0.0) * 1e3:.1f} ms / {lv.get('shard_cpu_s_per_upload', 0.0) * 1e3:.1f} ms",
          _saturation_cell(lv), _work_cell(lv)] for lv in sat["levels"]]))
    one = next((lv for lv in sat["levels"] if lv["shards"] == 1), None)
    for sp in sat.get("speedups", []):
        md.append(f"\n{sp['shards']} shards against one: merges/s {sp['merges_per_s']:.2f} / "
                  f"{sp['one_shard_merges_per_s']:.2f} = {sp['ratio']:.2f}x (target >= "
                  f"{TARGETS['shard_speedup']:.1f}x for 2); uploads accepted/s "
                  f"{sp.get('uploads_accepted_per_s_ratio', 0.0):.2f}x; shard CPU-s per merge "
                  f"{sp.get('shard_cpu_s_per_merge_ratio', 0.0):.2f}x one shard's.")
        bound = cpu_bound_speedup(sat, sp["shards"])
        if one is not None and not one.get("cpu_bound"):
            md.append(f"One shard was not bounded by its own CPU (it got {sum(one['shard_cpu_share_by_shard']):.2f} "
                      "cores): this speed-up measures what the machine's other load left the shards, not their "
                      "capacity.")
        elif one is not None and bound is not None:
            md.append(f"What the cores allow: one shard used {sum(one['shard_cpu_share_by_shard']):.2f} cores; "
                      f"with {sp['shards']} shards the replay processes took "
                      f"{_level_of(sat, sp['shards'])['replay_cpu_share']:.2f} of {sat.get('cores', 2)}, leaving the "
                      f"shards at most {bound['cores_left']:.2f} cores; at the CPU per merge measured with "
                      f"{sp['shards']} shards that caps the speed-up at {bound['speedup']:.2f}x.")
    md.append("\nShard CPU-s per merge and per upload do not depend on the machine's speed-up: they are the work "
              "one merge (its contributions' fold-ins, the outer step, publishing to every watcher) and one "
              "accepted upload cost, all the shards' CPU included. Every learner joins, watches and reports "
              "progress to every shard, so that part of a shard's work does not shrink with more shards: "
              "the CPU in brackets is the shards' with the same learners joined, watching and reporting "
              "progress, and no uploads.")
    return md


def _saturation_cell(lv: dict) -> str:
    if not lv.get("saturated"):
        return "NO"
    return "yes, CPU-bound" if lv.get("cpu_bound") else "yes, not CPU-bound"


def _level_of(sat: dict, shards: int) -> dict:
    return next(lv for lv in sat["levels"] if lv["shards"] == shards)


def cpu_bound_speedup(sat: dict, shards: int) -> dict | None:
    """The largest merges/s speed-up of `shards` shards over one that the machine's cores allow:
    the cores left to the shards (all but what the replay processes took at that shard count,
    at most one per shard) over the cores one shard used, times one shard's CPU per merge over
    `shards` shards' (None without CPU figures)."""
    levels = {lv["shards"]: lv for lv in sat["levels"]}
    one, many = levels.get(1), levels.get(shards)
    if not one or not many or "shard_cpu_share_by_shard" not in one or not many.get("shard_cpu_s_per_merge"):
        return None
    used_one = sum(one["shard_cpu_share_by_shard"])
    left = min(float(shards), sat.get("cores", 2) - many.get("replay_cpu_share", 0.0))
    if used_one <= 0:
        return None
    return {"cores_left": left,
            "speedup": left / used_one * one["shard_cpu_s_per_merge"] / many["shard_cpu_s_per_merge"]}


def markdown(result: dict) -> str:
    """perf.md for `result` (as `ddiloco bench perf` writes it to perf.json)."""
    md = _md_intro(result)
    for label, m in result.get("micro", {}).get("sizes", {}).items():
        md += _md_micro(label, m)
    for key in ("transport", "transport_large"):
        if result.get(key):
            md += _md_transport(key, result[key])
    if result.get("upload"):
        md += perf_upload.markdown(result["upload"], TARGETS["transport"])
    if result.get("overlap"):
        md += _md_overlap(result["overlap"])
    if result.get("scale"):
        md += _md_scale(result["scale"])
    if result.get("saturation"):
        md += md_saturation(result["saturation"])
    if result.get("sizes"):
        md += md_sizes(result["sizes"], result.get("previous"))
    notes = result.get("notes")
    if notes:
        md += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    md += ["", results_lib.provenance_markdown(result["provenance"])]
    return "\n".join(md)


# ---------------------------------------------------------------- model sizes, against the previous run


def size_rows(result: dict | None) -> list[dict]:
    """A run's model-size rows, each with its figures: the `sizes` rows; a run from before them
    (its scale section only) gives one row per scale level of its default model, one shard."""
    if not result:
        return []
    rows = list(result.get("sizes", {}).get("rows", []))
    if not rows and result.get("scale"):
        model = result["scale"].get("model", {})
        rows = [{"label": "", "model": model, "params": 0} | lv for lv in result["scale"]["levels"]]
    return rows


def previous_summary(previous: dict | None, source: str) -> dict | None:
    """What perf.json keeps of the previous committed run, to print beside this one's rows."""
    if not previous:
        return None
    prov = previous.get("provenance", {})
    return {"source": source, "commit": prov.get("commit", ""), "started_utc": prov.get("started_utc", ""),
            "dirty": prov.get("dirty", False), "rows": size_rows(previous)}


def previous_match(row: dict, previous_rows: list[dict]) -> dict | None:
    """The previous run's row for `row`: the same size (label, or the same model config), with
    the same shards and learners if it has them, else the nearest learner count."""
    same = [p for p in previous_rows if "not_run" not in p
            and ((p.get("label") and p["label"] == row["label"]) or p.get("model") == row["model"])]
    if not same:
        return None
    return min(same, key=lambda p: (p.get("shards", 1) != row.get("shards", 1),
                                    abs(p["learners"] - row["learners"])))


def _size_cells(row: dict) -> list[str]:
    share = row.get("accepted_steps", 0) / max(1, row.get("offered_steps", 0)) if row.get("offered_steps") else None
    return [f"{row.get('shards', 1)} x {row['learners']}", f"{row['merges_per_s']:.2f}",
            f"{row['merge_latency_p50_s']:.3f} / {row['merge_latency_p99_s']:.3f}",
            f"{row['upload_latency_p50_s']:.3f} / {row['upload_latency_p99_s']:.3f}",
            "-" if share is None else f"{share:.1%}",
            _mib(_peaks(row))]


FIGURES = ["shards x learners", "merges/s", "merge latency p50/p99 s", "upload latency p50/p99 s",
           "work merged", "peak RSS MiB per shard"]


def md_sizes(sizes: dict, previous: dict | None) -> list[str]:
    """One table: every model size's figures, this run and the previous committed run's beside."""
    prev_rows = (previous or {}).get("rows", [])
    md = ["", f"## Model size: synthetic models, {sizes['shards']} shards, {sizes['learners']} replay learners "
              f"(step {sizes['step_s']:.2f} s, default fragment schedule)", ""]
    rows = []
    for row in sizes["rows"]:
        prev = previous_match(row, prev_rows)
        prev_cells = _size_cells(prev) if prev else ["-"] * len(FIGURES)
        if "not_run" in row:
            now_cells = [f"{row['shards']} x {row['learners']}", f"not run: {row['not_run']}"] + [""] * (len(FIGURES) - 2)
        else:
            now_cells = _size_cells(row)
        rows.append([f"{row['label']} ({row['params']:,})"]
                    + [f"{now} (prev {was})" for now, was in zip(now_cells, prev_cells, strict=True)])
    md.append(results_lib.markdown_table(["model (parameters)"] + FIGURES, rows))
    if previous:
        md.append(f"\n'prev': the run committed in {previous['source']} (commit {previous['commit'][:12]}"
                  f"{', uncommitted changes' if previous.get('dirty') else ''}, {previous['started_utc']}); "
                  "a run from before the model-size rows gives its scale section's default model (one syncer) at "
                  "the nearest learner count; '-': not measured then.")
    md.append("\nA shard builds and keeps only the fragments it owns (services/syncer/initial.py: tensor by "
              "tensor, never the whole model; other shards' fragments are empty slots): its peak RSS grows with "
              "its share of the model, about perf_scale.SHARD_PEAK_BYTES_PER_OWNED_PARAM bytes per owned "
              "parameter above its start-up. A size "
              "whose estimated peak (perf_scale.memory_needed_bytes, measured per parameter) exceeds 90 % of the "
              "available memory is not started.")
    return md
