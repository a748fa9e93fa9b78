"""A SyncerCore to drive without gRPC: the fake clock the tests advance, the core factory, and the
learner-side calls (join, join_all, progress, upload) that feed it as the servicer does (the requests'
plain forms in, the responses built from the results: `join_request`, `progress_request`, `accept`);
and, for the learner loop's tests, a sync client without a syncer (`RecordingSyncClient`) and a
sampler for train steps that ignore their batch (`NullSampler`); for the codec tests, the
serialization inside an encoded payload (`serialized`).

`make_core` is the one place that turns a test's knobs into a SyncerCore; each test module passes
the knobs its scenario depends on, over the defaults below (those of the unit tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence

import numpy as np
import zstandard

from ddiloco.algo import fragments as fragments_lib
from ddiloco.learner import ports
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.syncer import config as config_lib
from services.syncer import core as core_lib
from services.syncer import wire_views


class FakeClock:
    """A clock that moves only when a test moves it (`now_s += ...` or `advance`)."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


# Two fragments of a small model with an embedding (its own merge rule).
SPECS = [fragments_lib.TensorSpec("a", (8, 4)), fragments_lib.TensorSpec("b", (16,)),
         fragments_lib.TensorSpec("emb", (4, 4), is_embedding=True)]

# The SyncerConfig fields a core is made with unless the test gives a whole `config`.
CONFIG_DEFAULTS = {"min_quorum": 1, "max_staleness_versions": 2, "num_fragments": 2, "overlap_steps": 2,
                   "sync_period_steps": 2, "upload_codec": "fp32"}
# The core's settings (CoreSettings) unless the test overrides them. Rounds open with their first
# upload (the RunConfig still says what `config` says: no learner reads it here).
CORE_DEFAULTS = {"outer_lr": 0.7, "outer_momentum": 0.9, "grace_gamma": 0.5, "max_grace_s": 10.0,
                 "liveness_timeout_s": 30.0, "merge_history": 16, "round_trigger": "upload"}
_SETTINGS = frozenset(f.name for f in dataclasses.fields(core_lib.CoreSettings))
# SyncerCore's own keyword arguments a test may give (stepper_factory, on_merge).
_CORE_ARGS = _SETTINGS | (frozenset(inspect.signature(core_lib.SyncerCore.__init__).parameters)
                          - {"self", "run", "plan", "initial_params", "settings", "clock", "wall_clock"})


def make_core(clock: Callable[[], float] | None = None, *, config: config_lib.SyncerConfig | None = None,
              specs: Sequence[fragments_lib.TensorSpec] = SPECS, staggered: bool = True, initial_std: float = 1.0,
              model_name: str = "test", **overrides) -> core_lib.SyncerCore:
    """A SyncerCore over a plan of `specs`, as the syncer builds one, without gRPC.

    clock: both its monotonic and wall clock (a FakeClock); None: the real ones.
    config: the fragment plan's shape and the RunConfig; without it, the SyncerConfig fields among
      `overrides` over CONFIG_DEFAULTS.
    initial_std: the initial parameters are N(0, initial_std^2) drawn from seed 0; 0 gives zeros.
    overrides: CoreSettings fields over CORE_DEFAULTS (a knob both take, such as grace_gamma, goes
      to the core: the one that acts on it), SyncerCore's stepper_factory / on_merge, and
      SyncerConfig fields.
    """
    core_kwargs = {**CORE_DEFAULTS, **{k: v for k, v in overrides.items() if k in _CORE_ARGS}}
    fields = {k: v for k, v in overrides.items() if k not in _CORE_ARGS}
    if config is None:
        config = config_lib.SyncerConfig(**{**CONFIG_DEFAULTS, **fields})
    elif fields:
        raise TypeError(f"give either a config or its fields, not both: {sorted(fields)}")
    plan = fragments_lib.plan_fragments(specs, config.num_fragments, config.sync_period_steps, staggered=staggered)
    run = core_lib.make_run_settings(config, model_name=model_name, model_config_json="{}", fingerprint="f" * 64)
    rng = np.random.default_rng(0)
    initial = {f.fragment_id: (initial_std * rng.standard_normal(f.numel)).astype(np.float32) if initial_std
               else np.zeros(f.numel, np.float32) for f in plan.fragments}
    clocks = {"clock": clock, "wall_clock": clock} if clock is not None else {"clock": time.monotonic,
                                                                              "wall_clock": time.time}
    settings = core_lib.CoreSettings(**{k: v for k, v in core_kwargs.items() if k in _SETTINGS})
    return core_lib.SyncerCore(run=run, plan=plan, initial_params=initial, settings=settings, **clocks,
                               **{k: v for k, v in core_kwargs.items() if k not in _SETTINGS})


def join(core: core_lib.SyncerCore, learner_id: str, incarnation: int = 1) -> syncer_pb2.JoinResponse:
    return join_request(core, syncer_pb2.JoinRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id,
                                                     incarnation=incarnation))


def join_request(core: core_lib.SyncerCore, request: syncer_pb2.JoinRequest) -> syncer_pb2.JoinResponse:
    """A Join as the servicer hands it to the core: the request's plain form in, the response built from the result."""
    joined = core.join(wire_views.join_args(request))
    return wire_views.join_response(core, joined.member, assign_data_shard=joined.assign_data_shard)


def join_all(core: core_lib.SyncerCore, learner_ids: Sequence[str], incarnation: int = 1) -> None:
    for learner_id in learner_ids:
        join(core, learner_id, incarnation)


def progress(core: core_lib.SyncerCore, learner_id: str, step_time_s: float, incarnation: int = 1) -> None:
    core.report_progress(wire_views.progress(syncer_pb2.ReportProgressRequest(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=incarnation, local_step=1,
        step_time_s=step_time_s)), wire_bytes=0)


def progress_request(core: core_lib.SyncerCore, request: syncer_pb2.ReportProgressRequest,
                     wire_bytes: int = 0) -> syncer_pb2.ReportProgressResponse:
    """A ReportProgress as the servicer hands it to the core, answered as the servicer answers it."""
    core.report_progress(wire_views.progress(request), wire_bytes=wire_bytes)
    return wire_views.progress_response(core.versions(), budget_reached=core.budget_reached())


async def upload(core: core_lib.SyncerCore, learner_id: str, fid: int, base: int, delta: np.ndarray, *,
                 steps: int = 2, incarnation: int = 1) -> syncer_pb2.UploadFragmentResponse:
    """An fp32 contribution of `steps` steps (100 tokens each) to fragment `fid`, based on version `base`."""
    enc = codec_lib.encode(delta.astype(np.float32), "fp32")
    header = syncer_pb2.UploadHeader(
        protocol_version=serde.PROTOCOL_VERSION, learner_id=learner_id, incarnation=incarnation, fragment_id=fid,
        base_version=base, syncer_instance=core.instance, steps=steps, tokens=steps * 100,
        payload=serde.payload_info_to_proto(enc),
    )
    return await accept(core, header, enc.payload, wire_bytes=len(enc.payload))


async def accept(core: core_lib.SyncerCore, header: syncer_pb2.UploadHeader, payload: bytes,
                 wire_bytes: int = 0) -> syncer_pb2.UploadFragmentResponse:
    """An upload as the servicer hands it to the core: the header's plain form in (validate_upload_header),
    the UploadFragmentResponse built from accept_upload's result."""
    ticket = core.validate_upload_header(wire_views.upload_header(header))
    return wire_views.upload_response(**(await core.accept_upload(ticket, payload, wire_bytes))._asdict())


async def settle() -> None:
    for _ in range(20):  # let merge tasks (which hop to worker threads) finish
        await asyncio.sleep(0.01)


async def settle_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """settle(), then more loop turns until `predicate()` holds, for at most `timeout_s`: for a merge
    that may run long (its first call compiles JAX code, seconds on a loaded machine). It does not
    wait for every task: tests hold uploads or watchers pending on purpose."""
    await settle()
    deadline_s = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline_s:
        await asyncio.sleep(0.01)


class RecordingSyncClient(ports.NullSyncClient):
    """A learner loop's sync client without a syncer: delivers the global fragments a test puts in
    `inbox` and records every upload the loop submits (in `uploads`)."""

    def __init__(self) -> None:
        self.inbox: list = []
        self.uploads: list = []

    def take_updates(self):
        out, self.inbox = self.inbox, []
        return out

    def submit_upload(self, job) -> None:
        self.uploads.append(job)


class NullSampler:
    """A sampler for fake train steps that ignore their batch: 64 tokens a batch, no data."""

    tokens_per_batch = 64

    def next(self):
        return None


def serialized(encoded) -> bytes:
    """The codec serialization inside a payload: zstd-decompressed, or as it is when the encoder
    judged that zstd would not pay (compression "none", e.g. int4 and tiny vectors)."""
    if encoded.compression == "none":
        return encoded.payload
    return zstandard.ZstdDecompressor().decompress(encoded.payload)
