"""The codec and merge micro-benchmarks of `ddiloco bench perf`, and the syncer's CPU work per upload.

Codec (host numpy/compiled and jitted JAX, int8/int4/int2), zstd, sha256, the fold-in and the
outer step, each in GB/s against a memory copy of the same values, measured interleaved in one
process pinned to one core (`ddiloco.bench.perf_workers.micro`). `upload_work_s` times the
syncer's own work on one upload for the transport section's ceiling, in the calling process.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable

import numpy as np
import zstandard

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.bench import perf_common as common
from ddiloco.wire import codec as codec_lib


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
UPLOAD_PATH = ("decode with norms and cosine (what the syncer runs)", "fold-in (merge)")


def _memcpy(values: np.ndarray) -> Callable[[], None]:
    dst = np.empty_like(values)
    return lambda: np.copyto(dst, values)


def _micro_codec(values: np.ndarray, codec: str, repeats: int, min_time_s: float) -> dict:
    import jax

    from ddiloco.wire import jax_codec

    numel, gbytes = values.size, values.nbytes / 1e9
    raw = codec_lib._serialize(values, codec, 128)
    device_values = jax_codec.to_device(values)
    jax.block_until_ready(jax_codec.quantize(device_values, codec))  # compile
    jax.block_until_ready(jax_codec.dequantize(raw, codec, numel))
    best = common.interleaved_best({
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
    gbytes = values.nbytes / 1e9
    out = {}
    for name, raw in (("int4", codec_lib._serialize(values, "int4", 128)), ("fp32", values.tobytes())):
        frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
        size = len(raw)
        best = common.interleaved_best({
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
    services/syncer/intake.py's `Intake._accept` runs it (callables to time; `memcpy` of the values for scale)."""
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
        # As Intake._accept runs it: the robust norms and the cosine with the last
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
    best = common.interleaved_best(_upload_path_stages(values), repeats, min_time_s)
    return {k: values.nbytes / 1e9 / v for k, v in best.items()} | {"memcpy_gbps": values.nbytes / 1e9 / best["memcpy"]}


def upload_work_s(values: np.ndarray, repeats: int) -> float:
    """Seconds of the syncer's own CPU work on one int4 upload of `values` (decode with norms
    and cosine, then fold-in; best of `repeats`, one thread): what the servicer must add to a
    bare stream whatever its transport does."""
    stages = _upload_path_stages(values)
    best = common.interleaved_best({k: stages[k] for k in UPLOAD_PATH}, repeats)
    return sum(best.values())


def _micro_merge(values: np.ndarray, repeats: int, min_time_s: float) -> dict:
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
    best = common.interleaved_best({
        "memcpy": _memcpy(values),
        "memcpy_step_set": _memcpy(step_set),
        # What the syncer runs: the tensors' norms come from the decode (robust.DecodedStats).
        "fold_in": lambda: acc.add(values, 2.0, norms=norms),
        "fold_in_own_norms": lambda: acc.add(values, 2.0),
        # What Rounds._merge_locked (services/syncer/merging.py) runs: the factored delta, stepped on in one pass.
        "outer_step": lambda: stepper.step_scaled(params, state, *acc.scaled_result(), write_grad=False),
        "result_only": acc.result,
        "stepper_only": lambda: stepper.step(params, state, values),
    }, repeats, min_time_s)
    out = {k: gbytes / v for k, v in best.items() if k != "memcpy_step_set"} | {"memcpy_gbps": gbytes / best["memcpy"]}
    # GB/s of params at which the step's five streams would move at the copy's speed.
    out["outer_step_traffic_bound"] = step_set.nbytes / 1e9 / best["memcpy_step_set"] * 2 / 5
    return out


def run_micro(workdir: pathlib.Path, sizes: dict[str, int], captured: str | None, quick: bool,
              timeout_s: float) -> dict:
    spec = {"sizes": sizes, "captured": captured, "repeats": 3 if quick else 7, "min_time_s": 0.0 if quick else 1.0,
            "cpu": max(os.sched_getaffinity(0))}
    return common.run_worker(workdir, "micro", "ddiloco.bench.perf_workers.micro", spec, timeout_s)
