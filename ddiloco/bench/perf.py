"""`ddiloco bench perf`: the syncer, codec and transport against what this machine allows.

Every figure is a ratio to a limit measured in the same invocation, on the same working set:

* codec: quantize+pack and unpack+dequantize (int8/int4/int2; the host codec ``codec.py``, as
  learners encode their uploads and the syncer its downloads: compiled loops and numpy; and the
  jitted ``jax_codec`` for values that live on an accelerator), in GB/s of float32 values, against
  memory-copy bandwidth (``np.copyto`` of the same float32 vector), one process pinned to one
  core. zstd compress/decompress throughput and ratio on pseudo-gradients captured from the
  training run of the overlap section (not random numbers), and sha256.
* merge: the syncer's fold-in of one contribution (``MergeAccumulator.add``) and the outer step
  of one fragment (``MergeAccumulator.scaled_result`` + ``OuterStepper.step_scaled``, as the
  syncer runs it), in GB/s of parameters
  (float32 bytes), against memory-copy bandwidth; same pinned process.
* transport: fragment uploads through a real syncer process (``python -m services.syncer``:
  servicer, header checks, decode, norm bound, fold-in, merges) against a bare gRPC stream of
  bytes (a minimal grpc.aio server process with no protobuf and no work), same client
  process, same chunk size and number of messages, in wire bytes per second.
* overlap: a real learner (the same LearnerLoop and SyncClient as ``services.learner``) trains
  against a real syncer; the share of the training thread's wall time spent in communication
  work (folding in arrived fragments, extracting pseudo-gradients and queueing uploads,
  building progress reports). The loop never blocks on the network by design, so this work is
  the only "waiting" it does. Measured at the default configuration and again through a TCP
  proxy (``ddiloco.chaos.proxy``) capped at the bandwidth the configuration needs.
* scale: one syncer process and 8..64 lightweight learners (identities driven by a few replay
  processes with asyncio: each joins, watches fragments, reports progress every step and uploads
  captured fragments on the default fragment schedule, based on the version it last heard of, as
  a real learner does): merges per second, upload and merge latency p50/p99, uploads accepted
  and refused (by the syncer's reason) against those the schedule offered, and the syncer's
  peak RSS (VmHWM), a fresh syncer per learner count.
  With `--syncer-shards 1,2` every learner count runs against 1 and 2 fragment shards (the replay
  learners send each fragment to its owner shard): merges/s side by side, their ratio, and each
  shard's peak RSS. Then the saturation levels (`--saturation-step-s`, `--saturation-learners`):
  the same shard counts with a step short enough that the schedule offers more rounds than one
  shard merges, with every process's CPU (docs/performance.md says what "saturated" means);
  `--saturation-params` runs them on a synthetic model of that size (larger fragments: more of
  each upload's cost in the shards), `--learners 0` runs the saturation levels alone.
* model size: codec, merge and transport figures for a ~100M-parameter model's fragments
  (synthetic tensors).
* sizes: the scale section's level on synthetic models of `--scale-sizes` parameters (0.5M, 100M,
  1B by default) with `--size-shards` shards and `--size-learners` replay learners, in one table
  beside the same rows of the previous committed run (`--previous`, bench/results/perf.json).

`--quick` runs every section small (tests); the default is the full run. The machine may be
shared: limits and figures are measured interleaved, best of several repeats.

This module holds the command (its flags, the order of the sections, the results it writes); each
section is its own module: ``perf_micro`` (codec, merge), ``perf_overlap``, ``perf_transport``,
``perf_upload``, ``perf_scale``, with ``perf_report`` (headline and perf.md), ``perf_common``
(timing, the processes started, through the launcher of ``ddiloco up``) and ``perf_identity``
(lightweight learners). The processes it starts besides the services are the modules of
``ddiloco.bench.perf_workers``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

from ddiloco.bench import perf_common as common
from ddiloco.bench import perf_micro, perf_overlap, perf_report, perf_scale, perf_transport, perf_upload
from ddiloco.bench import results as results_lib

NAME = "perf"

# Syncer configurations.
DEFAULT_MODEL = {"preset": "small"}
QUICK_MODEL = {"preset": "tiny"}
# ~100M parameters: 14 blocks of width 768 (12.6M each... here 7.1M) + embeddings.
LARGE_MODEL = {"preset": "small", "d_model": 768, "n_layers": 14, "n_heads": 12, "d_ff": 3072}
# Transport at the default model is dominated by per-RPC cost (payloads of ~64 KiB); a mid-size
# model makes multi-chunk uploads (~1.6 MiB).
TRANSPORT_MODEL = {"preset": "small", "d_model": 512, "n_layers": 4, "n_heads": 8, "d_ff": 2048}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="every section small and short (tests, ~1 min)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=results_lib.DEFAULT_OUT_DIR)
    parser.add_argument("--name", default=NAME, help="results are written to <out-dir>/<name>.json and .md")
    parser.add_argument("--sections", default="overlap,codec,merge,transport,upload,scale,model_size,sizes",
                        help="comma-separated subset of: overlap,codec,merge,transport,upload,scale,model_size,sizes")
    parser.add_argument("--replay-step-s", type=float, default=0.0,
                        help="the scale section's step time (default: the overlap section's measured one)")
    parser.add_argument("--rtt-ms", default="0,50",
                        help="added round-trip times of the upload section, comma-separated (ms)")
    parser.add_argument("--learners", default="",
                        help="learner counts of the scale section (default 8,16,32,64; 0: none, the saturation "
                             "levels only)")
    parser.add_argument("--large-params", type=float, default=0.0,
                        help="parameters of the model-size section (default ~100M; quick: 4M)")
    parser.add_argument("--syncer-shards", default="",
                        help="fragment shard counts of the scale section, comma-separated (default 1,2; quick: 1)")
    parser.add_argument("--saturation-step-s", type=float, default=-1.0,
                        help="the scale section's saturation levels: the replay learners' step time, short enough "
                             "that one shard cannot keep up with the schedule (default 0.005; quick: off); 0: off")
    parser.add_argument("--saturation-learners", type=int, default=16,
                        help="replay learners of the saturation levels")
    parser.add_argument("--saturation-params", default="",
                        help="the saturation levels on a synthetic model of about this many parameters (like 25M: "
                             "fragments of ~6M values) instead of the scale section's model (default)")
    parser.add_argument("--scale-sizes", default="",
                        help="model sizes of the sizes section, comma-separated parameter counts like 0.5M,100M,1B "
                             "(default 0.5M,100M,1B; quick: none unless given)")
    parser.add_argument("--size-shards", type=int, default=4, help="syncer shards of the sizes section")
    parser.add_argument("--size-learners", type=int, default=4, help="replay learners of the sizes section")
    parser.add_argument("--previous", type=pathlib.Path, default=common.ROOT / results_lib.DEFAULT_OUT_DIR / "perf.json",
                        help="the previous committed run, whose model-size rows are printed beside this run's")


def _scale_sizes(args: argparse.Namespace) -> list[str]:
    return [x.strip() for x in (args.scale_sizes or ("" if args.quick else "0.5M,100M,1B")).split(",") if x.strip()]


def _scale_sections(args: argparse.Namespace, result: dict, workdir: pathlib.Path, captured: pathlib.Path,
                    sections: set[str], model: dict, counts: list[int]) -> None:
    """The scale section (learner counts x shard counts) and the sizes section (model sizes)."""
    quick = bool(args.quick)
    step_s = args.replay_step_s or (max(0.05, result["overlap"]["default"]["step_s"]) if "overlap" in result
                                    else 0.25)
    if "scale" in sections and not captured.exists():
        # No training run in this invocation (--sections without overlap): synthetic
        # pseudo-gradients of the model's fragments, noted in the results.
        perf_scale.synthetic_capture(model, captured)
        result["notes"].append("scale: synthetic pseudo-gradients (no overlap section in this invocation)")
    if "scale" in sections:
        t0 = common.now()
        shard_counts = ([int(x) for x in args.syncer_shards.split(",")] if args.syncer_shards
                        else ([1] if quick else [1, 2]))
        if counts:
            result["scale"] = perf_scale.run_scale(workdir, model, captured, counts, seconds=3.0 if quick else 30.0,
                                                   step_s=step_s, processes=2, shard_counts=shard_counts)
        saturation_step_s = args.saturation_step_s if args.saturation_step_s >= 0 else (0.0 if quick else 0.005)
        if saturation_step_s > 0:
            result["saturation"] = perf_scale.run_saturation(
                workdir, model, captured, args.saturation_learners, saturation_step_s,
                seconds=3.0 if quick else 30.0, processes=2, shard_counts=shard_counts,
                params=perf_scale.parse_params(args.saturation_params) if args.saturation_params else 0)
        print(f"[perf] scale done in {common.now() - t0:.0f} s", flush=True)
    if "sizes" in sections and _scale_sizes(args):
        t0 = common.now()
        result["sizes"] = perf_scale.run_sizes(workdir, _scale_sizes(args), args.size_shards, args.size_learners,
                                               seconds=3.0 if quick else 30.0, step_s=step_s, processes=2)
        print(f"[perf] sizes done in {common.now() - t0:.0f} s", flush=True)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    quick = bool(args.quick)
    counts = [int(x) for x in args.learners.split(",")] if args.learners else ([3] if quick else [8, 16, 32, 64])
    counts = [c for c in counts if c > 0]  # "--learners 0": the saturation levels only
    if args.saturation_params:
        perf_scale.parse_params(args.saturation_params)  # a bad size fails now, not after the other sections
    large_params = int(args.large_params or (4e6 if quick else 100e6))
    model = QUICK_MODEL if quick else DEFAULT_MODEL
    for size in _scale_sizes(args):
        perf_scale.parse_params(size)  # a bad size fails now, not after the other sections
    result: dict = {"provenance": results_lib.provenance(), "quick": quick, "targets": perf_report.TARGETS,
                    "notes": [], "load_average_start": list(os.getloadavg())}
    # Read before this run writes anything (--out-dir may be where it lives).
    previous = json.loads(args.previous.read_text()) if args.previous and args.previous.exists() else None
    result["previous"] = perf_report.previous_summary(previous, str(args.previous))
    started = common.now()
    with tempfile.TemporaryDirectory(prefix="ddiloco-perf-") as tmp:
        workdir = pathlib.Path(tmp)
        captured = workdir / "captured.npz"
        if "overlap" in sections or ("scale" in sections and not args.replay_step_s):
            t0 = common.now()
            result["overlap"] = perf_overlap.run_overlap(workdir, model, steps=12 if quick else 96,
                                                         warmup=3 if quick else 8, batch_size=8 if quick else 16,
                                                         captured_path=captured, with_cap=True)
            result["overlap"]["seconds"] = common.now() - t0
            print(f"[perf] overlap done in {common.now() - t0:.0f} s", flush=True)
        if sections & {"codec", "merge", "model_size"}:
            t0 = common.now()
            sizes = {}
            if sections & {"codec", "merge"}:
                sizes["default"] = 0  # the captured fragment (or a default-size synthetic one)
                if not captured.exists():
                    sizes["default"] = 120_000
            if "model_size" in sections:
                sizes["large"] = large_params // 4  # one of P = 4 fragments
            result["micro"] = perf_micro.run_micro(workdir, sizes, str(captured) if captured.exists() else None,
                                                   quick, timeout_s=300 if quick else 900)
            print(f"[perf] codec/merge done in {common.now() - t0:.0f} s", flush=True)
        if "transport" in sections:
            t0 = common.now()
            result["transport"] = perf_transport.run_transport(workdir, QUICK_MODEL if quick else TRANSPORT_MODEL,
                                                               uploads=8 if quick else 40, tag="mid",
                                                               repeats=1 if quick else 3)
            print(f"[perf] transport done in {common.now() - t0:.0f} s", flush=True)
        if "model_size" in sections and not quick:
            t0 = common.now()
            result["transport_large"] = perf_transport.run_transport(workdir, LARGE_MODEL, uploads=8, tag="large",
                                                                     repeats=2)
            print(f"[perf] model-size transport done in {common.now() - t0:.0f} s", flush=True)
        if "upload" in sections:
            t0 = common.now()
            rtts = [float(x) / 1e3 for x in args.rtt_ms.split(",") if x.strip()]
            result["upload"] = [perf_upload.run_upload(workdir, QUICK_MODEL if quick else TRANSPORT_MODEL, "default upload",
                                                       rtts, uploads=4 if quick else 16)]
            if not quick:  # the same cells at 100M parameters, in the same invocation
                result["upload"].append(perf_upload.run_upload(workdir, LARGE_MODEL, "100M", rtts, uploads=6))
            print(f"[perf] upload done in {common.now() - t0:.0f} s", flush=True)
        _scale_sections(args, result, workdir, captured, sections, model, counts)
    result["seconds"] = common.now() - started
    result["load_average_end"] = list(os.getloadavg())
    result["headline"] = perf_report.headline(result)
    json_path, md_path = results_lib.write_result(args.out_dir, args.name, result, perf_report.markdown(result))
    print(f"[perf] wrote {json_path} and {md_path} ({result['seconds']:.0f} s)")
    return 0
