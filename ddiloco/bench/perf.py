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
* model size: codec, merge and transport figures for a ~100M-parameter model's fragments
  (synthetic tensors).

`--quick` runs every section small (tests); the default is the full run. The machine may be
shared: limits and figures are measured interleaved, best of several repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

from ddiloco.cli import service_names
from ddiloco.bench import perf_upload
from ddiloco.bench import results as results_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAME = "perf"

TARGETS = {
    "codec_int4_encode": 0.25,
    "merge": 0.30,
    "transport": 0.70,
    "overlap_max_share": 0.02,
}

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
    parser.add_argument("--sections", default="overlap,codec,merge,transport,upload,scale,model_size",
                        help="comma-separated subset of: overlap,codec,merge,transport,upload,scale,model_size")
    parser.add_argument("--replay-step-s", type=float, default=0.0,
                        help="the scale section's step time (default: the overlap section's measured one)")
    parser.add_argument("--rtt-ms", default="0,50",
                        help="added round-trip times of the upload section, comma-separated (ms)")
    parser.add_argument("--learners", default="", help="learner counts of the scale section (default 8,16,32,64)")
    parser.add_argument("--large-params", type=float, default=0.0,
                        help="parameters of the model-size section (default ~100M; quick: 4M)")


# ----------------------------------------------------------------------------- helpers


def _now() -> float:
    return time.perf_counter()


def interleaved_best(fns: dict[str, Callable[[], object]], repeats: int, min_time_s: float = 0.0) -> dict[str, float]:
    """Best wall time of each function, run interleaved (a, b, a, b, ...) so that both see the
    same machine load; at least `repeats` rounds and, if given, at least `min_time_s` in total."""
    best = {k: math.inf for k in fns}
    started = _now()
    rounds = 0
    while rounds < repeats or (_now() - started < min_time_s and rounds < repeats * 10):
        for key, fn in fns.items():
            t0 = _now()
            fn()
            best[key] = min(best[key], _now() - t0)
        rounds += 1
    return best


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def figure(name: str, value: float, unit: str, limit: float, limit_name: str, target: float | None = None,
           higher_is_better: bool = True, **extra) -> dict:
    ratio = value / limit if limit > 0 else 0.0
    out = {"name": name, "value": value, "unit": unit, "limit": limit, "limit_name": limit_name, "ratio": ratio}
    if target is not None:
        out["target"] = target
        out["meets_target"] = bool(ratio >= target) if higher_is_better else bool(ratio <= target)
    out.update(extra)
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["DDILOCO_INSECURE"] = "1"
    return env


def _run_python(code: str, timeout_s: float, *, cpu: int | None = None) -> dict:
    """Runs `code` in a fresh interpreter; it must print one JSON object as its last line."""
    env = _env()
    if cpu is not None:
        env["DDILOCO_BENCH_CPU"] = str(cpu)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def vm_hwm_bytes(pid: int) -> int:
    """Peak resident set size of a process (VmHWM), in bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class Service:
    """A service process started by this benchmark; stopped (and only it) by PID."""

    def __init__(self, name: str, argv: list[str], workdir: pathlib.Path) -> None:
        self.name = name
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self.ready_path = workdir / f"{name}.ready.json"
        self.ready_path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=_env(), cwd=workdir)
        self.address = ""
        self.info: dict = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float) -> str:
        deadline = _now() + timeout_s
        while _now() < deadline:
            if self.ready_path.exists():
                try:
                    self.info = json.loads(self.ready_path.read_text())
                except json.JSONDecodeError:  # being written
                    time.sleep(0.05)
                    continue
                self.address = self.info["address"].replace("0.0.0.0", "127.0.0.1")
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready within {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)


def start_syncer(workdir: pathlib.Path, name: str, model: dict, extra: list[str] = (), timeout_s: float = 180.0) -> Service:
    svc = Service(name, [
        sys.executable, "-m", service_names.module("services.syncer"), "--bind", "127.0.0.1:0",
        "--run-id", f"bench-{name}",
        "--ready-file", str(workdir / f"{name}.ready.json"), "--model-config", json.dumps(model),
        "--log-level", "WARNING", *extra,
    ], workdir)
    try:
        svc.wait_ready(timeout_s)
    except BaseException:
        svc.stop()
        raise
    return svc


@contextlib.contextmanager
def running_syncer(workdir: pathlib.Path, name: str, model: dict, extra: list[str] = ()):
    svc = start_syncer(workdir, name, model, list(extra))
    try:
        yield svc
    finally:
        svc.stop()


# ----------------------------------------------------------------------------- micro (codec, merge)

_MICRO_WORKER = r"""
import json, os, sys
cpu = int(os.environ.get("DDILOCO_BENCH_CPU", "-1"))
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
from ddiloco.bench import perf
print(json.dumps(perf.micro_worker(json.loads(sys.argv[1] if len(sys.argv) > 1 else %r))))
"""


def micro_worker(spec: dict) -> dict:
    """Codec and merge micro-benchmarks in this process (pinned to one core by the caller)."""
    out: dict = {"sizes": {}}
    captured = None
    if spec.get("captured"):
        with np.load(spec["captured"]) as data:
            captured = [data[k] for k in sorted(data.files)]
    for label, numel in spec["sizes"].items():
        if label == "default" and captured:
            # Real pseudo-gradients: the largest captured fragment of the default configuration.
            values = max(captured, key=lambda a: a.size).astype(np.float32)
        else:
            values = (np.random.default_rng(0).standard_normal(numel) * 1e-3).astype(np.float32)
        res = {"numel": values.size, "codec": {}}
        for codec in ("int8", "int4", "int2"):
            res["codec"][codec] = _micro_codec(values, codec, spec["repeats"], spec["min_time_s"])
        res["zstd"] = _micro_zstd(values, spec["repeats"], spec["min_time_s"], real=bool(label == "default" and captured))
        res["merge"] = _micro_merge(values, spec["repeats"], spec["min_time_s"])
        res["upload_path"] = _micro_upload_path(values, spec["repeats"], spec["min_time_s"])
        out["sizes"][label] = res
    return out


# The stages of _micro_upload_path that make up one upload's CPU work in the syncer.
_UPLOAD_PATH = ("decode with norms and cosine (what the syncer runs)", "fold-in (merge)")


def _memcpy(values: np.ndarray) -> Callable[[], None]:
    dst = np.empty_like(values)
    return lambda: np.copyto(dst, values)


def _micro_codec(values: np.ndarray, codec: str, repeats: int, min_time_s: float) -> dict:
    import jax

    from ddiloco.wire import codec as codec_lib
    from ddiloco.wire import jax_codec

    numel, gbytes = values.size, values.nbytes / 1e9
    raw = codec_lib._serialize(values, codec, 128)
    device_values = jax_codec.to_device(values)
    jax.block_until_ready(jax_codec.quantize(device_values, codec))  # compile
    jax.block_until_ready(jax_codec.dequantize(raw, codec, numel))
    best = interleaved_best({
        "memcpy": _memcpy(values),
        # What the syncer runs (numpy): absmax pass + quantize/pack pass; unpack/dequantize.
        "numpy_encode": lambda: codec_lib._serialize(values, codec, 128, codec_lib.block_absmax(values, 128)),
        "numpy_decode": lambda: codec_lib._deserialize(raw, codec, numel, 128),
        # What the learner runs (one jitted kernel each way), inputs already on the device.
        "jax_encode": lambda: jax.block_until_ready(jax_codec.quantize(device_values, codec)),
        "jax_decode": lambda: jax.block_until_ready(jax_codec.dequantize(raw, codec, numel)),
    }, repeats, min_time_s)
    return {k: gbytes / v for k, v in best.items()} | {"memcpy_gbps": gbytes / best["memcpy"]}


def _micro_zstd(values: np.ndarray, repeats: int, min_time_s: float, real: bool) -> dict:
    import zstandard

    from ddiloco.wire import codec as codec_lib

    gbytes = values.nbytes / 1e9
    out = {}
    for name, raw in (("int4", codec_lib._serialize(values, "int4", 128)), ("fp32", values.tobytes())):
        frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
        size = len(raw)
        best = interleaved_best({
            "compress": lambda raw=raw: zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw),
            "decompress": lambda frame=frame, size=size: zstandard.ZstdDecompressor().decompress(frame, max_output_size=size),
            "sha256": lambda frame=frame: hashlib.sha256(frame).digest(),
            "memcpy": _memcpy(values),
        }, repeats, min_time_s)
        out[name] = {
            "ratio": size / len(frame),
            "compress_gbps_raw": size / 1e9 / best["compress"],
            "decompress_gbps_raw": size / 1e9 / best["decompress"],
            "compress_gbps_fp32": gbytes / best["compress"],
            "decompress_gbps_fp32": gbytes / best["decompress"],
            "sha256_gbps": len(frame) / 1e9 / best["sha256"],
            "memcpy_gbps": gbytes / best["memcpy"],
            "real_pseudo_gradients": real,
        }
    return out


def _upload_path_stages(values: np.ndarray) -> dict[str, Callable[[], object]]:
    """The syncer's per-upload work on one int4 contribution of `values`, stage by stage, as
    `SyncerCore._accept_upload` runs it (callables to time; `memcpy` of the values for scale)."""
    from ddiloco.algo import fragments as fragments_lib
    from ddiloco.algo import merge as merge_lib
    from ddiloco.algo import robust as robust_lib
    from ddiloco.wire import codec as codec_lib

    numel = values.size
    sizes = [numel // 4, numel // 4, numel // 4, numel - 3 * (numel // 4)]
    fragment = fragments_lib.Fragment(
        fragment_id=0, offset_steps=0,
        tensors=tuple(fragments_lib.TensorSpec(f"t{i}", (n,), is_embedding=(i == 0)) for i, n in enumerate(sizes)),
    )
    enc = codec_lib.encode(values, "int4")
    params = (np.random.default_rng(2).standard_normal(numel) * 0.02).astype(np.float32)
    last = (values * 0.5).astype(np.float32)
    acc = merge_lib.MergeAccumulator(fragment)
    norms = robust_lib.tensor_norms(values, fragment)  # what the decode hands the fold-in

    last_norm = merge_lib.vector_norm(last)

    def decode(on_chunk=None):
        return codec_lib.decode(enc.payload, codec="int4", numel=numel, raw_size_bytes=enc.raw_size_bytes,
                                checksum=enc.checksum, on_chunk=on_chunk)

    def decode_with_stats():
        # As SyncerCore._accept_upload runs it: the robust norms and the cosine with the last
        # merge gathered while each decoded piece is in cache (its second decode thread aside).
        stats = robust_lib.DecodedStats(fragment, last, last_norm)
        decoded = decode(stats.update)
        norms = stats.tensor_norms(decoded)
        return stats.cosine(decoded, norms)

    return {
        "memcpy": _memcpy(values),
        "decode (sha256, zstd, dequantize)": decode,
        "decode with norms and cosine (what the syncer runs)": decode_with_stats,
        "fold-in (merge)": lambda: acc.add(values, 1.0, norms=norms),
        "params norm (once per fragment version)": lambda: merge_lib.vector_norm(params),
    }


def _micro_upload_path(values: np.ndarray, repeats: int, min_time_s: float) -> dict:
    """The syncer's per-upload work, stage by stage (GB/s of float32 values, against
    memory-copy bandwidth)."""
    best = interleaved_best(_upload_path_stages(values), repeats, min_time_s)
    return {k: values.nbytes / 1e9 / v for k, v in best.items()} | {"memcpy_gbps": values.nbytes / 1e9 / best["memcpy"]}


def upload_work_s(values: np.ndarray, repeats: int) -> float:
    """Seconds of the syncer's own CPU work on one int4 upload of `values` (decode with norms
    and cosine, then fold-in; best of `repeats`, one thread): what the servicer must add to a
    bare stream whatever its transport does."""
    stages = _upload_path_stages(values)
    best = interleaved_best({k: stages[k] for k in _UPLOAD_PATH}, repeats)
    return sum(best.values())


def _micro_merge(values: np.ndarray, repeats: int, min_time_s: float) -> dict:
    from ddiloco.algo import fragments as fragments_lib
    from ddiloco.algo import merge as merge_lib
    from ddiloco.algo import outer as outer_lib

    numel, gbytes = values.size, values.nbytes / 1e9
    # A fragment of four tensors: one embedding (weighted mean), three RDA.
    sizes = [numel // 4, numel // 4, numel // 4, numel - 3 * (numel // 4)]
    fragment = fragments_lib.Fragment(
        fragment_id=0, offset_steps=0,
        tensors=tuple(fragments_lib.TensorSpec(f"t{i}", (n,), is_embedding=(i == 0)) for i, n in enumerate(sizes)),
    )
    acc = merge_lib.MergeAccumulator(fragment)
    acc.add(values, 1.0)
    norms = np.array([np.linalg.norm(values[where]) for where in fragment.slices().values()])
    stepper = outer_lib.OuterStepper(outer_lib.make_outer_optimizer())
    params = (np.random.default_rng(1).standard_normal(numel) * 0.02).astype(np.float32)
    state = stepper.init(params)
    # The outer step reads three vectors (sums, params, momentum) and writes two (params,
    # momentum; the delta stays factored): five streams. A copy of three vectors moves six over
    # the same working set, so its speed bounds the step at 6/5 of a third of it in GB/s of params
    # (the plain memcpy of one vector may stay in cache where the step's working set does not).
    step_set = np.concatenate([values, params, values])
    best = interleaved_best({
        "memcpy": _memcpy(values),
        "memcpy_step_set": _memcpy(step_set),
        # What the syncer runs: the tensors' norms come from the decode (robust.DecodedStats).
        "fold_in": lambda: acc.add(values, 2.0, norms=norms),
        "fold_in_own_norms": lambda: acc.add(values, 2.0),
        # What SyncerCore._merge_locked runs: the factored delta, stepped on in one pass.
        "outer_step": lambda: stepper.step_scaled(params, state, *acc.scaled_result(), write_grad=False),
        "result_only": acc.result,
        "stepper_only": lambda: stepper.step(params, state, values),
    }, repeats, min_time_s)
    out = {k: gbytes / v for k, v in best.items() if k != "memcpy_step_set"} | {"memcpy_gbps": gbytes / best["memcpy"]}
    # GB/s of params at which the step's five streams would move at the copy's speed.
    out["outer_step_traffic_bound"] = step_set.nbytes / 1e9 / best["memcpy_step_set"] * 2 / 5
    return out


def run_micro(sizes: dict[str, int], captured: str | None, quick: bool, timeout_s: float) -> dict:
    spec = {"sizes": sizes, "captured": captured, "repeats": 3 if quick else 7, "min_time_s": 0.0 if quick else 1.0}
    code = _MICRO_WORKER % json.dumps(spec)
    cpu = max(os.sched_getaffinity(0))
    return _run_python(code, timeout_s, cpu=cpu)


# ----------------------------------------------------------------------------- overlap (real learner)


class _Timed:
    """Wraps a callable and accumulates the wall time spent in it."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        t0 = _now()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += _now() - t0
            self.calls += 1


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):  # a thread that just ended
            continue
    return out


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _learner_run(target: str, steps: int, warmup: int, capture: dict | None, batch_size: int,
                 null_client: bool = False, shard: int = 0, compiled: dict | None = None,
                 syncer_pid: int | None = None) -> dict:
    """Trains one in-process learner for `steps` steps; returns the time shares. `compiled`
    keeps the jitted train step between runs of the same model (one compilation)."""
    from ddiloco import models
    from ddiloco.algo import fragments as fragments_lib
    from ddiloco.data import corpus
    from ddiloco.rpc import security as security_lib
    from ddiloco.wire import codec as codec_lib
    from ddiloco.wire import serde
    from ddiloco.learner import client as client_lib
    from ddiloco.learner import loop as loop_lib
    from ddiloco.learner import ports as ports_lib
    train_lib = service_names.load("services.learner.train")

    incarnation = time.time_ns()
    learner_id = f"bench-learner-{shard}"
    client = client_lib.SyncClient(client_lib.ClientConfig(
        target=target, learner_id=learner_id, incarnation=incarnation, region="bench", tokens_per_step=0,
        security=security_lib.ClientSecurity(insecure=True),
    ))
    run_config = client.start(120.0)
    try:
        model = models.get_model(run_config.model_name, json.loads(run_config.model_config_json))
        plan = serde.plan_from_proto(run_config.fragments, run_config.sync_period_steps)
        docs = corpus.load_stdlib_documents(max_bytes=2 << 20)
        split = corpus.split_corpus(docs, 4, 0.05, source_name=corpus.STDLIB_SOURCE_NAME)
        sampler = corpus.BatchSampler(split.shards[shard], batch_size, model.seq_len, seed=shard)
        optimizer = train_lib.make_inner_optimizer(train_lib.InnerOptConfig())
        params = {spec.name: np.zeros(spec.shape, np.float32) for spec in model.tensor_specs()}
        # A client that never delivers anything: the loop then does no communication work.
        loop_client = ports_lib.NullSyncClient() if null_client else client
        key = run_config.model_config_json
        if compiled is None or key not in compiled:
            train_step = train_lib.TrainStep(model, optimizer)
            if compiled is not None:
                compiled[key] = train_step
        else:
            train_step = compiled[key]
        loop = loop_lib.LearnerLoop(plan=plan, params=params, train_step=train_step,
                                    sampler=sampler, client=loop_client, learner_id=learner_id,
                                    incarnation=incarnation, mixing_alpha=run_config.mixing_alpha,
                                    on_arrival=run_config.on_arrival, round_trigger=run_config.round_trigger)
        if null_client:  # start from the global parameters, then never hear from the syncer again
            for update in client.take_updates():
                frag = plan.fragments[update.fragment_id]
                for name, arr in fragments_lib.unflatten_fragment(update.values, frag).items():
                    loop.params[name] = loop._train_step.place(name, arr)
        else:
            loop.apply_updates()
        if capture is not None:
            original_submit = client.submit_upload

            def capturing_submit(job):
                capture.setdefault(job.fragment_id, []).append(np.array(job.delta, copy=True))
                original_submit(job)

            client.submit_upload = capturing_submit
        # As the learner's __main__ does at start-up (in a thread there): the host codec's
        # compiled kernels are loaded before training, not by the first upload in the timed steps.
        codec_lib.warm_up()
        for _ in range(warmup):
            loop.step()
        # Decoupled mode: a contribution is extracted and queued by _contribute (on the syncer's call).
        timers = {"apply_updates": _Timed(loop.apply_updates), "queue_upload": _Timed(loop._contribute),
                  "progress_request": _Timed(loop.progress_request),
                  "set_progress": _Timed(loop_client.set_progress)}
        loop.apply_updates = timers["apply_updates"]
        loop._contribute = timers["queue_upload"]
        loop.progress_request = timers["progress_request"]
        loop_client.set_progress = timers["set_progress"]
        stats0 = dict(vars(client.stats))
        training_tid = threading.get_native_id()
        cpu0, syncer0 = _thread_cpu_s(), process_cpu_s(syncer_pid) if syncer_pid else 0.0
        started = _now()
        for _ in range(steps):
            loop.step()
        wall = _now() - started
        cpu1, syncer1 = _thread_cpu_s(), process_cpu_s(syncer_pid) if syncer_pid else 0.0
        stats1 = dict(vars(client.stats))
        training_cpu = cpu1.get(training_tid, 0.0) - cpu0.get(training_tid, 0.0)
        other_cpu = sum(v - cpu0.get(k, 0.0) for k, v in cpu1.items() if k != training_tid)
        comm = sum(t.seconds for t in timers.values())
        fragment_numels = [f.numel for f in plan.fragments]
        return {
            "steps": steps, "wall_s": wall, "step_s": wall / steps, "comm_s": comm, "comm_share": comm / wall,
            # CPU seconds per step: the training thread, the learner's other threads (sync client,
            # its codec workers, XLA), and the syncer process: what competes for the 2 cores.
            "training_thread_cpu_per_step_s": training_cpu / steps,
            "other_threads_cpu_per_step_s": other_cpu / steps,
            "syncer_cpu_per_step_s": (syncer1 - syncer0) / steps,
            "by_part_s": {k: t.seconds for k, t in timers.items()},
            "uploads_queued": timers["queue_upload"].calls, "fragments_applied": loop.stats.fragments_applied,
            "client": {k: stats1[k] - stats0.get(k, 0) for k in stats1 if isinstance(stats1[k], (int, float))},
            "fragment_numels": fragment_numels, "sync_period_steps": plan.sync_period_steps,
            "upload_codec": serde.codec_from_proto(run_config.upload_codec),
            "download_codec": serde.codec_from_proto(run_config.download_codec),
            "block_size": run_config.upload_block_size,
        }
    finally:
        client.close(leave=True, timeout_s=5.0)


def needed_bandwidth(run: dict) -> dict:
    """Bytes per second each direction needs at the measured step time, from the configuration:
    every fragment goes up (upload codec) and comes down (download codec) once per H steps."""
    from ddiloco.wire import codec as codec_lib

    up = sum(codec_lib.expected_raw_size_bytes(run["upload_codec"], n, run["block_size"]) for n in run["fragment_numels"])
    down = sum(codec_lib.expected_raw_size_bytes(run["download_codec"], n, run["block_size"]) for n in run["fragment_numels"])
    per_s = 1.0 / (run["sync_period_steps"] * run["step_s"])
    return {"up_bytes_per_s": up * per_s, "down_bytes_per_s": down * per_s}


def run_overlap(workdir: pathlib.Path, model: dict, steps: int, warmup: int, batch_size: int, captured_path: pathlib.Path,
                with_cap: bool) -> dict:
    from ddiloco.chaos import proxy as proxy_lib

    out: dict = {"model": model, "definition": (
        "share of the training thread's wall time spent in communication work: folding in arrived "
        "fragments (apply_updates), extracting pseudo-gradients and queueing uploads (_contribute), "
        "building and handing over progress reports. The loop never blocks on the network by design.")}
    capture: dict = {}
    compiled: dict = {}
    # Rounds opened by the learner's own counter (--round-trigger upload): a contribution every
    # H / P steps from the first step on, so a short timed window always holds the same uploads (with
    # the syncer's schedule they follow its calls; the work per upload is the same).
    with running_syncer(workdir, "syncer-overlap", model, ["--round-trigger", "upload"]) as syncer:
        pid = syncer.pid
        out["null"] = _learner_run(syncer.address, steps, warmup, None, batch_size, null_client=True, shard=1,
                                   compiled=compiled, syncer_pid=pid)
        out["default"] = _learner_run(syncer.address, steps, warmup, capture, batch_size, shard=0, compiled=compiled,
                                      syncer_pid=pid)
        # The null run again: the machine's load changes between runs; keep the faster one.
        again = _learner_run(syncer.address, steps, warmup, None, batch_size, null_client=True, shard=1,
                             compiled=compiled, syncer_pid=pid)
        if again["step_s"] < out["null"]["step_s"]:
            out["null"] = again
        need = needed_bandwidth(out["default"])
        out["needed_bandwidth"] = need
        if with_cap:
            cap = max(need["up_bytes_per_s"], need["down_bytes_per_s"])
            host, port = syncer.address.rsplit(":", 1)
            proxy = proxy_lib.FaultProxy("127.0.0.1", host, int(port))
            proxy_port = proxy.start_in_thread()
            try:
                proxy.set(bandwidth_bytes_per_s=cap)
                out["capped"] = _learner_run(f"127.0.0.1:{proxy_port}", steps, warmup, None, batch_size, shard=2,
                                             compiled=compiled, syncer_pid=pid)
                out["capped"]["cap_bytes_per_s"] = cap
            finally:
                proxy.close()
    arrays = {f"f{fid}_{i}": d for fid, deltas in capture.items() for i, d in enumerate(deltas[-3:])}
    if arrays:
        np.savez(captured_path, **arrays)
    out["captured_fragments"] = len(arrays)
    out["throughput_cost"] = 1.0 - out["null"]["step_s"] / out["default"]["step_s"]
    return out


# ----------------------------------------------------------------------------- transport

_BARE_SERVER = r"""
import asyncio, json, os, sys
import grpc
from ddiloco.rpc import server as server_lib

async def main(ready):
    async def sink(request_iterator, context):
        n = 0
        async for chunk in request_iterator:
            n += len(chunk)
        return n.to_bytes(8, "little")
    handler = grpc.method_handlers_generic_handler("bench.Bare", {
        "Upload": grpc.stream_unary_rpc_method_handler(sink)})
    server = grpc.aio.server(options=server_lib.SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(ready + ".tmp", "w") as f:
        json.dump({"address": f"127.0.0.1:{port}", "pid": os.getpid()}, f)
    os.replace(ready + ".tmp", ready)
    await server.wait_for_termination()

asyncio.run(main(sys.argv[1]))
"""


async def _bare_uploads(address: str, payload_chunks: list[bytes], uploads: int, deadline_s: float,
                        in_flight: int = 1) -> tuple[float, int]:
    """Seconds and bytes for `uploads` streams of `payload_chunks` to the bare sink, at most
    `in_flight` at a time."""
    import grpc

    from ddiloco.rpc import channel as channel_lib

    channel = channel_lib.aio_channel(address, None)
    try:
        call = channel.stream_unary("/bench.Bare/Upload", request_serializer=None, response_deserializer=None)
        await call(iter(payload_chunks[:1]), timeout=deadline_s)  # connect and warm up
        gate = asyncio.Semaphore(in_flight)

        async def one() -> None:
            async with gate:
                await call(iter(payload_chunks), timeout=deadline_s)

        started = _now()
        await asyncio.gather(*(one() for _ in range(uploads)))
        return _now() - started, uploads * sum(len(c) for c in payload_chunks)
    except grpc.RpcError as exc:
        raise RuntimeError(f"bare gRPC upload failed: {exc}") from None
    finally:
        await channel.close()


class _Identity:
    """One lightweight learner: joined, watching versions, uploading prepared payloads."""

    def __init__(self, stub, learner_id: str, instance: str = "") -> None:
        self.stub = stub
        self.learner_id = learner_id
        self.incarnation = time.time_ns()
        self.instance = instance
        self.versions: dict[int, int] = {}
        self.sent_base: dict[int, int] = {}
        self.pipeline_bytes = 0

    async def join(self, timeout_s: float) -> None:
        from ddiloco.v1 import syncer_pb2
        from ddiloco.wire import serde

        resp = await self.stub.Join(syncer_pb2.JoinRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
            region="bench"), timeout=timeout_s)
        self.instance = resp.syncer_instance
        self.versions = serde.versions_from_proto(resp.fragment_versions)
        self.pipeline_bytes = resp.upload_pipeline_bytes

    async def watch(self, stop: asyncio.Event, stream_s: float) -> None:
        """Reads the fragment stream (payloads discarded): keeps `versions` current."""
        from ddiloco.v1 import syncer_pb2
        from ddiloco.wire import serde

        while not stop.is_set():
            call = self.stub.WatchFragments(syncer_pb2.WatchFragmentsRequest(
                protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
                syncer_instance=self.instance, held=serde.versions_to_proto(self.versions)), timeout=stream_s)
            try:
                async for msg in call:
                    if msg.WhichOneof("kind") == "header":
                        self.versions[msg.header.fragment_id] = msg.header.version
                    if stop.is_set():
                        call.cancel()
                        return
            except Exception:  # noqa: BLE001 - deadline or shutdown: re-open unless stopping
                if stop.is_set():
                    return
                await asyncio.sleep(0.1)

    async def report_progress(self, stop: asyncio.Event, step_s: float, steps: Callable[[], int],
                              timeout_s: float) -> None:
        """Reports progress every step, as a real learner's SyncClient does (its step time is what
        the syncer's grace window is computed from; without it every upload is merged alone)."""
        import grpc

        from ddiloco.v1 import syncer_pb2
        from ddiloco.wire import serde

        while not stop.is_set():
            try:
                await self.stub.ReportProgress(syncer_pb2.ReportProgressRequest(
                    protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
                    local_step=steps(), step_time_s=step_s, held=serde.versions_to_proto(self.versions)),
                    timeout=timeout_s)
            except grpc.aio.AioRpcError:  # transient, like the learner's: the next tick sends again
                pass
            await asyncio.sleep(step_s)

    def messages(self, fid: int, base: int, info, chunks: list[bytes], steps: int, tokens: int, final: bool = False):
        from ddiloco.v1 import common_pb2, syncer_pb2
        from ddiloco.wire import serde

        header = syncer_pb2.UploadHeader(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id, incarnation=self.incarnation,
            fragment_id=fid, base_version=base, syncer_instance=self.instance, steps=steps, tokens=tokens,
            payload=info, final=final)
        msgs = [syncer_pb2.UploadFragmentRequest(header=header)]
        msgs += [syncer_pb2.UploadFragmentRequest(chunk=common_pb2.PayloadChunk(seq=i, data=c, last=i == len(chunks) - 1))
                 for i, c in enumerate(chunks)]
        return msgs


def _prepare_payloads(deltas: dict[int, np.ndarray], chunk_size: int, codec: str = "int4") -> dict[int, tuple]:
    from ddiloco.wire import codec as codec_lib
    from ddiloco.wire import serde

    out = {}
    for fid, delta in deltas.items():
        enc = codec_lib.encode(np.ascontiguousarray(delta, np.float32), codec)
        out[fid] = (serde.payload_info_to_proto(enc), codec_lib.chunk_payload(enc.payload, chunk_size))
    return out


async def _servicer_uploads(address: str, payloads: dict[int, tuple], uploads: int, identities: int,
                            deadline_s: float, in_flight: int = 1) -> dict:
    """Uploads through the real syncer, at most `in_flight` at a time, cycling identities and
    fragments (upload n comes from identity n % identities, to fragment n % P, based on the
    version that identity last heard of). With `in_flight` up to P, uploads in flight are to
    different fragments, as one learner's are."""
    import grpc

    from ddiloco.rpc import channel as channel_lib
    from ddiloco.v1 import syncer_pb2_grpc

    channel = channel_lib.aio_channel(address, None)
    stub = syncer_pb2_grpc.SyncerStub(channel)
    try:
        tag = os.urandom(3).hex()
        ids = [_Identity(stub, f"transport-{tag}-{i}") for i in range(identities)]
        for ident in ids:
            await ident.join(deadline_s)
        fids = sorted(payloads)
        results = {"accepted": 0, "refused": 0, "codes": {}}
        latencies = []
        gate = asyncio.Semaphore(in_flight)

        async def one(n: int) -> int:
            """Upload n; returns its wire bytes (0 for the warm-up upload)."""
            ident = ids[n % len(ids)]
            fid = fids[n % len(fids)]
            info, chunks = payloads[fid]
            async with gate:
                msgs = ident.messages(fid, ident.versions.get(fid, 0), info, chunks, steps=8, tokens=8 * 2048)
                t0 = _now()
                try:
                    resp = await stub.UploadFragment(iter(msgs), timeout=deadline_s)
                    ident.versions[fid] = max(ident.versions.get(fid, 0), resp.current_version)
                    results["accepted"] += n > 0
                except grpc.aio.AioRpcError as exc:
                    results["refused"] += n > 0
                    results["codes"][exc.code().name] = results["codes"].get(exc.code().name, 0) + 1
                    # Learn the current version for the next try.
                    await ident.join(deadline_s)
                if n > 0:
                    latencies.append(_now() - t0)
            return sum(m.ByteSize() for m in msgs) if n > 0 else 0

        await one(0)  # warm-up upload (first-call costs), then the measured ones
        started = _now()
        sent = sum(await asyncio.gather(*(one(n) for n in range(1, uploads + 1))))
        results["seconds"] = _now() - started
        results["wire_bytes"] = sent
        results["latency_p50_s"] = percentile(latencies, 50)
        return results
    finally:
        await channel.close()


def run_transport(workdir: pathlib.Path, model: dict, uploads: int, tag: str, repeats: int) -> dict:
    """Upload throughput through the real servicer vs a bare gRPC bytes stream."""
    from ddiloco import models
    from ddiloco.algo import fragments as fragments_lib

    bare = Service(f"bare-{tag}", [sys.executable, "-c", _BARE_SERVER, str(workdir / f"bare-{tag}.ready.json")], workdir)
    try:
        bare.wait_ready(60)
        # No merges while measuring: a quorum no round reaches (one contribution per identity and
        # fragment), so the figure is transport + checks + decode + norm bound + fold-in. The
        # merge itself is the merge section's figure (and the scale section runs it end to end).
        with running_syncer(workdir, f"syncer-transport-{tag}", model,
                            ["--min-quorum", "1000000", "--max-grace-s", "600",
                             "--liveness-timeout-s", "600"]) as syncer:
            specs = models.get_model("transformer", model).tensor_specs()
            plan = fragments_lib.plan_fragments(specs, 4, 8)
            rng = np.random.default_rng(0)
            deltas = {f.fragment_id: (rng.standard_normal(f.numel) * 1e-4).astype(np.float32) for f in plan.fragments}
            payloads = _prepare_payloads(deltas, 512 * 1024)
            payloads_fp32 = _prepare_payloads(deltas, 512 * 1024, "fp32")
            deadline = 120.0
            best_real, best_bare, best_fp32, real = 0.0, 0.0, 0.0, {}
            # As a syncer sees them: one learner has one upload per fragment in flight, and
            # many learners upload at once. The bare stream gets the same concurrency.
            in_flight = len(plan.fragments)
            best_conc, best_bare_conc, conc = 0.0, 0.0, {}
            for _ in range(repeats):  # interleaved: both see the same machine load
                res = asyncio.run(_servicer_uploads(syncer.address, payloads, uploads, uploads + 1, deadline))
                rate = res["wire_bytes"] / res["seconds"] if res["seconds"] > 0 else 0.0
                if rate > best_real:
                    best_real, real = rate, res
                res_conc = asyncio.run(_servicer_uploads(syncer.address, payloads, uploads, uploads + 1, deadline,
                                                         in_flight=in_flight))
                rate = res_conc["wire_bytes"] / res_conc["seconds"] if res_conc["seconds"] > 0 else 0.0
                if rate > best_conc:
                    best_conc, conc = rate, res_conc
                # fp32 uploads: 7.5x the wire bytes for the same decode-and-fold work per value.
                res32 = asyncio.run(_servicer_uploads(syncer.address, payloads_fp32, max(2, uploads // 4),
                                                      uploads + 1, deadline))
                best_fp32 = max(best_fp32, res32["wire_bytes"] / res32["seconds"] if res32["seconds"] > 0 else 0.0)
                # The bare stream carries the same chunks (largest fragment), as many messages.
                info, chunks = payloads[max(payloads, key=lambda f: len(payloads[f][1]))]
                seconds, sent = asyncio.run(_bare_uploads(bare.address, chunks, uploads, deadline))
                best_bare = max(best_bare, sent / seconds)
                seconds, sent = asyncio.run(_bare_uploads(bare.address, chunks, uploads, deadline, in_flight))
                best_bare_conc = max(best_bare_conc, sent / seconds)
            syncer_rss = vm_hwm_bytes(syncer.pid)
    finally:
        bare.stop()
    numel = sum(f.numel for f in plan.fragments)
    # The ceiling any servicer design has here: a bare stream that also does the syncer's own
    # work on each upload (decode with norms and cosine, fold-in; measured now, in this process,
    # on the largest fragment), serially or perfectly overlapped with the transfer.
    largest = max(payloads, key=lambda f: deltas[f].size)
    upload_bytes = sum(len(c) for c in payloads[largest][1])
    bare_s = upload_bytes / best_bare if best_bare else 0.0
    work_s = upload_work_s(deltas[largest], repeats=3 if repeats == 1 else 7)
    return {"model": model, "params": numel, "fragment_numels": [f.numel for f in plan.fragments],
            "uploads": uploads, "servicer_bytes_per_s": best_real, "bare_bytes_per_s": best_bare,
            "ratio": best_real / best_bare if best_bare else 0.0, "servicer_run": real, "syncer_peak_rss_bytes": syncer_rss,
            "servicer_fp32_bytes_per_s": best_fp32, "ratio_fp32": best_fp32 / best_bare if best_bare else 0.0,
            "upload_bytes": upload_bytes, "bare_s_per_upload": bare_s, "work_s_per_upload": work_s,
            "servicer_s_per_upload": upload_bytes / best_real if best_real else 0.0,
            "ceiling_serial": bare_s / (bare_s + work_s) if bare_s + work_s > 0 else 0.0,
            "ceiling_overlapped": bare_s / max(bare_s, work_s) if max(bare_s, work_s) > 0 else 0.0,
            "in_flight": in_flight, "servicer_concurrent_bytes_per_s": best_conc, "servicer_concurrent_run": conc,
            "bare_concurrent_bytes_per_s": best_bare_conc,
            "ratio_concurrent": best_conc / best_bare_conc if best_bare_conc else 0.0}


# ----------------------------------------------------------------------------- scale (replay processes)

_REPLAY_WORKER = r"""
import asyncio, json, sys
from ddiloco.bench import perf
print(json.dumps(asyncio.run(perf.replay_main(json.loads(sys.argv[1])))))
"""


async def _replay_send(ctx: dict, ident: _Identity, fid: int, base: int, steps: int, state: dict,
                       final: bool) -> None:
    """One replay upload with the learner's real client; on acceptance its steps are merged work
    and the syncer's back-pressure hint holds the fragment's next upload. `final`: the learner's
    last contribution of the fragment (the syncer merges its round without waiting for it)."""
    import grpc

    from ddiloco.rpc import errors as errors_lib
    from ddiloco.learner import client as client_lib

    info, chunks = ctx["payloads"][fid]
    msgs = ident.messages(fid, base, info, chunks, steps=steps, tokens=steps * 2048, final=final)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        # The base stays what the watch stream delivered: a real learner cannot rebase on a
        # version it has not received (the response's current_version).
        resp = await client_lib.send_upload(ctx["stub"], msgs, 30, pipeline_bytes=ident.pipeline_bytes)
        ctx["counts"]["accepted"] += 1
        ctx["work"]["accepted_steps"] += steps
        state["pending"][fid] -= steps
        ident.sent_base[fid] = base
        if resp.next_upload_after_s > 0:
            ctx["work"]["slowed"] += 1
            state["hold"][fid] = loop.time() + resp.next_upload_after_s
    except grpc.aio.AioRpcError as exc:  # the work stays pending: it goes in the next contribution
        ctx["counts"]["refused"] += 1
        ctx["refusals"][exc.code().name] = ctx["refusals"].get(exc.code().name, 0) + 1
        if errors_lib.reason_of(exc) == "already_pending":  # the open round has its last one: wait for it
            ident.sent_base[fid] = base
    ctx["latencies"].append(loop.time() - t0)


def _replay_try_send(ctx: dict, ident: _Identity, fid: int, state: dict, final: bool) -> bool:
    """Starts an upload of the fragment's pending work if the replay learner may send one now."""
    base = ident.versions.get(fid, 0)
    if fid in state["sending"] or state["pending"][fid] <= 0 or ident.sent_base.get(fid) == base:
        return False  # one upload per fragment in flight, one contribution per base version
    if not final and asyncio.get_running_loop().time() < state["hold"].get(fid, 0.0):
        return False  # back-pressure: this period's work joins the next contribution
    task = asyncio.create_task(_replay_send(ctx, ident, fid, base, state["pending"][fid], state, final))
    state["sending"][fid] = task
    task.add_done_callback(lambda _t: state["sending"].pop(fid, None))
    return True


async def replay_main(spec: dict) -> dict:
    """A replay process: `spec["ids"]` learner identities, each joining, watching and uploading
    the captured payloads on the fragment schedule for `spec["seconds"]`."""

    from ddiloco.rpc import channel as channel_lib
    from ddiloco.v1 import common_pb2, syncer_pb2_grpc

    with np.load(spec["captured"]) as data:
        deltas = {}
        for key in sorted(data.files):
            fid = int(key.split("_")[0][1:])
            deltas.setdefault(fid, data[key])
    payloads = _prepare_payloads(deltas, spec["chunk_size"])
    payloads = {fid: (common_pb2.PayloadInfo.FromString(info.SerializeToString()), chunks)
                for fid, (info, chunks) in payloads.items()}
    channel = channel_lib.aio_channel(spec["address"], None)
    stub = syncer_pb2_grpc.SyncerStub(channel)
    stop = asyncio.Event()
    latencies: list[float] = []
    counts = {"accepted": 0, "refused": 0, "skipped": 0}
    refusals: dict[str, int] = {}
    fids = sorted(payloads)
    step_s = spec["step_s"]
    period = spec["sync_period_steps"]
    offsets = {fid: (fid * period) // len(fids) for fid in fids}

    work = {"offered_steps": 0, "accepted_steps": 0, "pending_steps_end": 0, "slowed": 0, "final_sent": 0}
    ctx = {"stub": stub, "payloads": payloads, "counts": counts, "refusals": refusals, "work": work,
           "latencies": latencies}

    def try_send(ident: _Identity, fid: int, state: dict, *, final: bool = False) -> bool:
        return _replay_try_send(ctx, ident, fid, state, final)

    async def learner(index: int) -> None:
        ident = _Identity(stub, f"replay-{spec['first']+index}")
        await ident.join(30)
        watch = asyncio.create_task(ident.watch(stop, 60))
        step = index % period  # learners are not in phase
        progress = asyncio.create_task(ident.report_progress(stop, step_s, lambda: step, timeout_s=10))
        loop = asyncio.get_running_loop()
        next_at = loop.time() + (index % 16) * step_s / 16
        state = {"pending": dict.fromkeys(fids, 0), "hold": {}, "sending": {}}
        try:
            while not stop.is_set():
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                next_at += step_s
                step += 1
                for fid in fids:
                    if stop.is_set():
                        break
                    due = step % period == offsets[fid]
                    if due:
                        state["pending"][fid] += period  # one period of work on this fragment
                        work["offered_steps"] += period
                    if not try_send(ident, fid, state) and due:
                        counts["skipped"] += 1  # held, in flight, or the base did not move: kept
            # The end of the run: what is pending goes out once its base allows (bounded wait).
            deadline = loop.time() + spec.get("flush_s", 10.0)
            while loop.time() < deadline and (state["sending"] or any(state["pending"].values())):
                for fid in fids:
                    work["final_sent"] += try_send(ident, fid, state, final=True)
                await asyncio.sleep(0.05)
            for task in list(state["sending"].values()):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, 35)
            work["pending_steps_end"] += sum(state["pending"].values())
        finally:
            watch.cancel()
            progress.cancel()

    tasks = [asyncio.create_task(learner(i)) for i in range(spec["ids"])]
    await asyncio.sleep(spec["seconds"])
    stop.set()
    await asyncio.wait(tasks, timeout=spec.get("flush_s", 10.0) + 40)
    for t in tasks:
        t.cancel()
    await channel.close()
    # What the schedule asked for: one upload per fragment every sync period per identity.
    offered = round(spec["ids"] * len(fids) * spec["seconds"] / (step_s * period))
    return {"latencies": latencies, "refusals": refusals, "offered": offered, **counts, **work}


def _synthetic_capture(model: dict, path: pathlib.Path) -> None:
    """Random pseudo-gradients (std 1e-4) of each of the model's default fragments, saved as the
    overlap section saves captured ones."""
    from ddiloco import models
    from ddiloco.algo import fragments as fragments_lib

    plan = fragments_lib.plan_fragments(models.get_model("transformer", model).tensor_specs(), 4, 8)
    rng = np.random.default_rng(0)
    np.savez(path, **{f"f{f.fragment_id}_0": (rng.standard_normal(f.numel) * 1e-4).astype(np.float32)
                      for f in plan.fragments})


def run_scale(workdir: pathlib.Path, model: dict, captured: pathlib.Path, counts: list[int], seconds: float,
              step_s: float, processes: int) -> dict:
    from ddiloco.rpc import channel as channel_lib
    from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc

    out = {"model": model, "step_s": step_s, "seconds": seconds, "levels": []}
    for count in counts:
        with running_syncer(workdir, f"syncer-scale-{count}", model, ["--liveness-timeout-s", "30"]) as syncer:
            rss_idle = vm_hwm_bytes(syncer.pid)
            per = [count // processes + (1 if i < count % processes else 0) for i in range(processes)]
            procs = []
            first = 0
            for n in per:
                if n == 0:
                    continue
                spec = {"address": syncer.address, "captured": str(captured), "ids": n, "first": first,
                        "seconds": seconds, "step_s": step_s, "sync_period_steps": 8, "chunk_size": 512 * 1024,
                        "flush_s": 10.0}
                first += n
                procs.append(subprocess.Popen([sys.executable, "-c", _REPLAY_WORKER, json.dumps(spec)],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT))
            probe = channel_lib.sync_channel(syncer.address)
            stub = syncer_pb2_grpc.SyncerStub(probe)
            # Skip the joins and first uploads; measure merges over the middle of the run.
            time.sleep(min(2.0, seconds / 4))
            s0 = stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=10).state
            t0 = _now()
            time.sleep(seconds * 0.6)
            s1 = stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=256), timeout=10).state
            t1 = _now()
            lat = [m.quorum_wait_s + m.grace_used_s for m in s1.recent_merges]
            replays = []
            for p in procs:
                try:
                    stdout, stderr = p.communicate(timeout=seconds + 120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    stdout, stderr = p.communicate(timeout=30)
                if p.returncode != 0:
                    raise RuntimeError(f"replay process failed: {stderr[-3000:]}")
                replays.append(json.loads(stdout.strip().splitlines()[-1]))
            # The syncer's own upload counters (refusals by reason: stale, already_pending, busy...).
            final = stub.GetTrainingState(syncer_pb2.GetTrainingStateRequest(recent_merges=0), timeout=10).state
            probe.close()
            upload_lat = [x for r in replays for x in r["latencies"]]
            out["levels"].append({
                "learners": count,
                "merges_per_s": (s1.outer_steps - s0.outer_steps) / (t1 - t0),
                "merge_latency_p50_s": percentile(lat, 50), "merge_latency_p99_s": percentile(lat, 99),
                "merge_compute_s": s1.sync_time_s,
                "upload_latency_p50_s": percentile(upload_lat, 50), "upload_latency_p99_s": percentile(upload_lat, 99),
                "uploads_accepted": sum(r["accepted"] for r in replays), "uploads_refused": sum(r["refused"] for r in replays),
                "uploads_skipped": sum(r["skipped"] for r in replays),
                "uploads_offered": sum(r["offered"] for r in replays),
                # Work in learner-steps per fragment: trained (offered), in accepted contributions
                # (each in exactly one merge), still pending when the run ended (kept, not sent).
                **{key: sum(r[key] for r in replays) for key in
                   ("offered_steps", "accepted_steps", "pending_steps_end", "slowed", "final_sent")},
                "refusals": {code: sum(r["refusals"].get(code, 0) for r in replays)
                             for code in sorted({c for r in replays for c in r["refusals"]})},
                "syncer_uploads": dict(final.uploads),
                "syncer_cpu_s": process_cpu_s(syncer.pid),
                "syncer_peak_rss_bytes": vm_hwm_bytes(syncer.pid), "syncer_rss_before_learners_bytes": rss_idle,
            })
    return out


# ----------------------------------------------------------------------------- report


def _headline(result: dict) -> list[dict]:
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
    ov = result.get("overlap")
    if ov:
        for key in ("default", "capped"):
            if key in ov:
                rows.append(figure(f"learner time in communication work ({key})", ov[key]["comm_share"], "share of wall",
                                   1.0, "wall time", TARGETS["overlap_max_share"], higher_is_better=False))
    return rows


def _markdown(result: dict) -> str:
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
    micro = result.get("micro", {}).get("sizes", {})
    for label, m in micro.items():
        md += ["", f"## Codec and merge, {m['numel']:,} values ({label}), one core", ""]
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
            path = [k for k in _UPLOAD_PATH if k in up] or stages
            total_s = sum(1.0 / up[k] for k in path)
            md.append(results_lib.markdown_table(
                ["syncer work per int4 upload", "GB/s fp32", "of memcpy", "share of the upload's CPU time"],
                [[k, f"{up[k]:.2f}", f"{up[k] / up['memcpy_gbps']:.0%}", f"{(1.0 / up[k]) / total_s:.0%}" if k in path else "-"]
                 for k in stages]
                + [["per upload (" + " + ".join(path) + ")", f"{1.0 / total_s:.2f}",
                    f"{(1.0 / total_s) / up['memcpy_gbps']:.0%}", "100%"]]))
    for key in ("transport", "transport_large"):
        t = result.get(key)
        if t:
            md += ["", "No merge runs while uploads are measured (a quorum no round reaches), so the figure is the "
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
    if result.get("upload"):
        md += perf_upload.markdown(result["upload"], TARGETS["transport"])
    ov = result.get("overlap")
    if ov:
        md += ["", "## Learner overlap", "", ov["definition"], ""]
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
    sc = result.get("scale")
    if sc:
        md += ["", f"## Scale: one syncer, lightweight learners replaying captured fragments "
                   f"(step {sc['step_s']:.2f} s, default fragment schedule)", ""]
        md.append(results_lib.markdown_table(
            ["learners", "merges/s", "work merged (steps accepted/trained; uploads slowed by back-pressure)",
             "merge latency p50/p99 s", "upload latency p50/p99 s",
             "uploads acc/ref (offered)", "syncer RSS MiB before learners / peak"],
            [[lv["learners"], f"{lv['merges_per_s']:.2f}",
              f"{lv.get('accepted_steps', 0) / max(1, lv.get('offered_steps', 0)):.1%} "
              f"({lv.get('accepted_steps', 0)}/{lv.get('offered_steps', 0)}; {lv.get('slowed', 0)} slowed)", f"{lv['merge_latency_p50_s']:.3f} / {lv['merge_latency_p99_s']:.3f}",
              f"{lv['upload_latency_p50_s']:.3f} / {lv['upload_latency_p99_s']:.3f}",
              f"{lv['uploads_accepted']}/{lv['uploads_refused']}"
              + (f" ({lv['uploads_offered']})" if "uploads_offered" in lv else "")
              + (" " + ", ".join(f"{k} {v}" for k, v in lv.get("refusals", {}).items()) if lv.get("refusals") else "")
              + ("; " + ", ".join(f"{k[len('rejected_'):]} {v}" for k, v in sorted(lv.get("syncer_uploads", {}).items())
                                  if k.startswith("rejected_")) if lv.get("refusals") else ""),
              f"{lv['syncer_rss_before_learners_bytes'] / 2**20:.0f} / {lv['syncer_peak_rss_bytes'] / 2**20:.0f}"]
             for lv in sc["levels"]]))
        md.append("\nMerge latency: round opened to merge started (quorum wait + grace used), from the syncer's merge "
                  "records; upload latency: client-side UploadFragment round trip (decode and fold-in included). "
                  "Uploads offered: what the fragment schedule asks of the replay learners in the run; refusals "
                  "by status code, then by the syncer's reason. The replay learners report progress every step "
                  "like real ones (the grace window is computed from their step time) and upload on the version "
                  "they last heard of; they share the 2 cores with the syncer. Peak RSS: the merge state is one "
                  "accumulator per fragment whatever the number of learners; per learner the syncer holds one "
                  "download chunk (at most 128 KiB, the messages of a version built once for all watchers) and "
                  "at most 3 x P decoded contributions wait for a fragment's lock; the direction check keeps "
                  "16 references per fragment; malloc arenas are capped at 2 (per-thread arenas kept ~100 MiB "
                  "of freed buffers at 64 learners) and BLAS calls run single-threaded (ddiloco.runtime).")
    notes = result.get("notes")
    if notes:
        md += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    md += ["", results_lib.provenance_markdown(result["provenance"])]
    return "\n".join(md)


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    quick = bool(args.quick)
    counts = [int(x) for x in args.learners.split(",")] if args.learners else ([3] if quick else [8, 16, 32, 64])
    large_params = int(args.large_params or (4e6 if quick else 100e6))
    model = QUICK_MODEL if quick else DEFAULT_MODEL
    result: dict = {"provenance": results_lib.provenance(), "quick": quick, "targets": TARGETS, "notes": [],
                    "load_average_start": list(os.getloadavg())}
    started = _now()
    with tempfile.TemporaryDirectory(prefix="ddiloco-perf-") as tmp:
        workdir = pathlib.Path(tmp)
        captured = workdir / "captured.npz"
        if "overlap" in sections or ("scale" in sections and not args.replay_step_s):
            t0 = _now()
            result["overlap"] = run_overlap(workdir, model, steps=12 if quick else 96, warmup=3 if quick else 8,
                                            batch_size=8 if quick else 16, captured_path=captured,
                                            with_cap=True)
            result["overlap"]["seconds"] = _now() - t0
            print(f"[perf] overlap done in {_now() - t0:.0f} s", flush=True)
        if sections & {"codec", "merge", "model_size"}:
            t0 = _now()
            sizes = {}
            if sections & {"codec", "merge"}:
                sizes["default"] = 0  # the captured fragment (or a default-size synthetic one)
                if not captured.exists():
                    sizes["default"] = 120_000
            if "model_size" in sections:
                sizes["large"] = large_params // 4  # one of P = 4 fragments
            result["micro"] = run_micro(sizes, str(captured) if captured.exists() else None, quick,
                                        timeout_s=300 if quick else 900)
            print(f"[perf] codec/merge done in {_now() - t0:.0f} s", flush=True)
        if "transport" in sections:
            t0 = _now()
            result["transport"] = run_transport(workdir, QUICK_MODEL if quick else TRANSPORT_MODEL,
                                                uploads=8 if quick else 40, tag="mid", repeats=1 if quick else 3)
            print(f"[perf] transport done in {_now() - t0:.0f} s", flush=True)
        if "model_size" in sections and not quick:
            t0 = _now()
            result["transport_large"] = run_transport(workdir, LARGE_MODEL, uploads=8, tag="large", repeats=2)
            print(f"[perf] model-size transport done in {_now() - t0:.0f} s", flush=True)
        if "upload" in sections:
            t0 = _now()
            rtts = [float(x) / 1e3 for x in args.rtt_ms.split(",") if x.strip()]
            result["upload"] = [perf_upload.run_upload(workdir, QUICK_MODEL if quick else TRANSPORT_MODEL, "default upload",
                                                       rtts, uploads=4 if quick else 16)]
            if not quick:  # the same cells at 100M parameters, in the same invocation
                result["upload"].append(perf_upload.run_upload(workdir, LARGE_MODEL, "100M", rtts, uploads=6))
            print(f"[perf] upload done in {_now() - t0:.0f} s", flush=True)
        if "scale" in sections and not captured.exists():
            # No training run in this invocation (--sections without overlap): synthetic
            # pseudo-gradients of the model's fragments, noted in the results.
            _synthetic_capture(model, captured)
            result["notes"].append("scale: synthetic pseudo-gradients (no overlap section in this invocation)")
        if "scale" in sections and captured.exists():
            t0 = _now()
            step_s = (args.replay_step_s or max(0.05, result["overlap"]["default"]["step_s"]) if "overlap" in result
                      else args.replay_step_s or 0.25)
            result["scale"] = run_scale(workdir, model, captured, counts, seconds=3.0 if quick else 30.0,
                                        step_s=step_s, processes=2)
            print(f"[perf] scale done in {_now() - t0:.0f} s", flush=True)
    result["seconds"] = _now() - started
    result["load_average_end"] = list(os.getloadavg())
    result["headline"] = _headline(result)
    json_path, md_path = results_lib.write_result(args.out_dir, args.name, result, _markdown(result))
    print(f"[perf] wrote {json_path} and {md_path} ({result['seconds']:.0f} s)")
    return 0
