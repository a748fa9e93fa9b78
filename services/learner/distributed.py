"""A learner unit that spans several devices and hosts: its mesh, and lockstep between its processes.

In Decoupled DiLoCo a learner unit is an island of accelerators running ordinary data-parallel
training inside. Here that island is one JAX program: `LearnerUnit` picks the devices (all local
ones by default, on every process of the unit), builds the `("data", "fsdp")` mesh the train step
runs on (`train.make_mesh`) and, for a unit of several processes, initializes
`jax.distributed` from the configuration first.

Only process 0 of a multi-process unit (the leader) talks to the syncer. `UnitClient` stands in
for the SyncClient on every process, so the training loop is the same code everywhere, and keeps
the processes in lockstep: every `take_updates()` is a collective call. Each step

1. all processes all-gather a small fixed-size header: the leader's part says which fragments
   arrived (id, version, syncer instance, the merge receipt's mark), which rounds the syncer
   called, how many upload outcomes came back, and whether the syncer fenced the unit off;
   every process adds its own stop request (SIGTERM), and the unit stops when any process asked;
2. the leader broadcasts the flat values of each arrived fragment, one fragment at a time
   (`multihost_utils.broadcast_one_to_all`), and, for a fragment whose version holds the unit's
   contribution, the values the syncer decoded from it (what a rebase adds back), so every
   process folds in the same values at the same step;
3. the leader broadcasts the upload outcomes (accepted, refused) when there are any.
Round calls and outcomes are handed to the loop by the non-collective `take_calls` and
`take_outcomes` from what the last exchange agreed, so the fragment schedule (which depends only
on those) stays identical on every process.

Uploads and progress reports go out from the leader only; on the other processes they are no-ops.
A unit of one process uses the plain SyncClient (no wrapper, no collectives).

Must not: know the model or the optimizer (train.py) or the fragment schedule (loop.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde
from ddiloco.learner import client as client_lib
from . import train as train_lib

_LOG = logging.getLogger("ddiloco.learner")

# Exit outcomes of the leader's join, broadcast so that every process of the unit exits alike.
_JOIN_OK, _JOIN_TIMEOUT, _JOIN_FENCED, _JOIN_ERROR = 0, 3, 4, 5
# The exchange header: (stop, fenced, outcomes), then per fragment (arrived, version, instance
# tag, receipt mark, decoded values follow, called, call version, call round).
_HEADER_INTS, _PER_FRAGMENT_INTS = 3, 8


def parse_mesh_shape(text: str) -> tuple[int, int] | None:
    """`"DATAxFSDP"` (e.g. `"2x4"`) to `(2, 4)`; empty to None. Raises ValueError otherwise."""
    text = text.strip().lower()
    if not text:
        return None
    parts = text.split("x")
    try:
        if len(parts) != 2:
            raise ValueError
        data, fsdp = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"mesh shape {text!r}: use DATAxFSDP, e.g. '4x1' or '2x2'") from None
    if data < 1 or fsdp < 1:
        raise ValueError(f"mesh shape {text!r}: both sizes must be >= 1")
    return data, fsdp


def _int64_bytes(values) -> np.ndarray:
    # JAX truncates int64 to int32 unless x64 is on: move int64 as bytes (exact under psum with
    # zeros, which is what broadcast_one_to_all does).
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64)).view(np.uint8)


def _from_int64_bytes(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).view(np.int64)


@dataclasses.dataclass(frozen=True)
class LearnerUnit:
    """The devices and processes of one learner unit (see the module docstring)."""

    process_index: int
    process_count: int
    devices: tuple  # every device of the unit, process-major
    mesh: jax.sharding.Mesh | None  # None: one device, one process (the plain jit path)

    @property
    def is_leader(self) -> bool:
        return self.process_index == 0

    @property
    def multi_process(self) -> bool:
        return self.process_count > 1

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        if self.mesh is None:
            return (1, 1)
        return (self.mesh.shape[train_lib.DATA_AXIS], self.mesh.shape[train_lib.FSDP_AXIS])

    # ------------------------------------------------------------------ agreement between processes

    def agree_int(self, value: int) -> int:
        """The leader's value of a (64-bit) int, on every process."""
        if not self.multi_process:
            return int(value)
        return int(_from_int64_bytes(multihost_utils.broadcast_one_to_all(_int64_bytes([value])))[0])

    def agree_bytes(self, data: bytes) -> bytes:
        """The leader's bytes on every process (followers pass anything, e.g. b"")."""
        if not self.multi_process:
            return data
        size = self.agree_int(len(data) if self.is_leader else 0)
        buf = np.frombuffer(data, np.uint8) if self.is_leader else np.zeros(size, np.uint8)
        if size == 0:
            return b""
        return np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8).tobytes()

    def check_same(self, what: Mapping[str, object]) -> None:
        """Fails on every process if the processes were configured differently (e.g. another
        learner id or batch size): a unit is one learner, and its processes must agree."""
        if not self.multi_process:
            return
        digest = hashlib.sha256(repr(sorted(what.items())).encode()).digest()[:8]
        gathered = np.asarray(multihost_utils.process_allgather(np.frombuffer(digest, np.uint8)))
        if not all(bytes(row) == bytes(gathered[0]) for row in gathered.reshape(self.process_count, -1)):
            raise ValueError(
                f"the {self.process_count} processes of this learner unit are configured differently "
                f"(these must be equal on every process: {sorted(what)})"
            )

    # ------------------------------------------------------------------ the sync client

    def wrap_client(self, client: client_lib.SyncClient, stop: threading.Event):
        """The client the learner loop uses: `client` itself for a one-process unit, else a
        `UnitClient` (the leader's wraps `client`; the others never start it)."""
        if not self.multi_process:
            return client
        return UnitClient(self, client, stop)

    def should_stop(self, client, stop: threading.Event) -> bool:
        """Whether to stop before the next step: the local event for a one-process unit; for a
        multi-process unit the decision all processes agreed on at the last exchange."""
        if not self.multi_process:
            return stop.is_set()
        return client.stop_agreed

    def describe(self) -> dict:
        return {"processes": self.process_count, "process_index": self.process_index,
                "devices": self.num_devices, "mesh": "x".join(map(str, self.mesh_shape)),
                "platform": self.devices[0].platform if self.devices else ""}


def init_unit(
    *,
    num_devices: int = 0,
    mesh_shape: str = "",
    fsdp: bool = False,
    coordinator_address: str = "",
    num_processes: int = 1,
    process_id: int = 0,
    batch_size: int | None = None,
    initialization_timeout_s: int = 300,
) -> LearnerUnit:
    """Initializes `jax.distributed` (several processes) and picks the unit's devices and mesh.

    Call before anything else touches a JAX device.

    Args:
        num_devices: devices of each process to use; 0: all local devices.
        mesh_shape: "DATAxFSDP" over all the unit's devices; empty: all of them on the data axis
            (replicated parameters), or on the fsdp axis when `fsdp`.
        fsdp: shard parameters and optimizer state over all the unit's devices.
        coordinator_address, num_processes, process_id: `jax.distributed.initialize` arguments
            (used only when num_processes > 1).
        batch_size: the unit's global batch; checked to be divisible by the device count.
        initialization_timeout_s: bound on waiting for the other processes at start.

    Raises:
        ValueError: on an impossible device count, mesh shape or batch size.
    """
    if num_processes > 1:
        if not coordinator_address:
            raise ValueError("a learner unit of several processes needs --coordinator-address HOST:PORT")
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
            initialization_timeout=initialization_timeout_s,
        )
    local = jax.local_devices()
    use = num_devices or len(local)
    if use > len(local):
        raise ValueError(
            f"--num-devices {num_devices} but this process sees {len(local)} device(s) "
            f"({local[0].platform}): lower it, or 0 for all"
        )
    count = jax.process_count()
    devices = tuple(
        d for p in range(count) for d in sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[:use]
    )
    shape = parse_mesh_shape(mesh_shape)
    if shape is None:
        shape = (1, len(devices)) if fsdp else (len(devices), 1)
    elif fsdp and shape[1] == 1 and len(devices) > 1:
        raise ValueError(f"--fsdp with --mesh-shape {mesh_shape}: the fsdp axis has size 1; use e.g. 1x{len(devices)}")
    if shape[0] * shape[1] != len(devices):
        raise ValueError(
            f"--mesh-shape {mesh_shape} needs {shape[0] * shape[1]} devices but the unit has {len(devices)} "
            f"({count} process(es) x {use})"
        )
    if batch_size is not None and batch_size % len(devices):
        raise ValueError(
            f"--batch-size {batch_size} is not divisible by the unit's {len(devices)} devices: the global batch is "
            "split evenly across them"
        )
    mesh = None if len(devices) == 1 and count == 1 else train_lib.make_mesh(devices, shape)
    return LearnerUnit(process_index=jax.process_index(), process_count=count, devices=devices, mesh=mesh)


def params_sha256(params: Mapping[str, jax.Array], to_host=train_lib.TrainStep.to_host) -> str:
    """sha256 over the tensors (sorted by name, float32 little-endian), one tensor on the host at a
    time; equal on every process of a unit whose parameters are equal."""
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(to_host(params[name]), dtype="<f4").tobytes())
    return digest.hexdigest()


class UnitClient:
    """The SyncClient of a multi-process unit, on every process (see the module docstring).

    The loop's interface (ports.SyncClientLike) plus what `__main__` uses (`start`, `flush`,
    `close`, `stats`): `agree_any` makes the loop's own decisions the same everywhere (the
    end-of-training deadline). The syncer life has no name here (`instance` is None: followers
    only see the leader's tag), and the synchronous baselines' barrier (`arrivals`,
    `wait_for_arrivals`, `held_values`, `take_refused`) is inert: `__main__` refuses those modes
    for multi-process units.
    """

    instance: str | None = None

    def instance_of(self, fragment_id: int) -> str | None:
        return self.instance  # never named here (see the class docstring)

    def __init__(self, unit: LearnerUnit, client: client_lib.SyncClient, stop: threading.Event) -> None:
        self._unit = unit
        self._client = client if unit.is_leader else None
        self._stop = stop
        self._numels: list[int] = []
        self.run_config: syncer_pb2.RunConfig | None = None
        self.data_shard = -1  # the leader's, after start()
        self.schedule_start_step = 0  # the leader's, after start()
        self.stop_agreed = False
        self.fenced: client_lib.FencedError | None = None
        self.exchanges = 0
        # What the last exchange agreed, handed out by take_calls / take_outcomes.
        self._calls: dict[int, syncer_pb2.RoundCall] = {}
        self._outcomes: list[client_lib.UploadOutcome] = []
        # The newest job the loop submitted per fragment, on every process: a follower's copy gets
        # the values the leader's client sent (decoded), for the rebase.
        self._jobs: dict[int, client_lib.UploadJob] = {}

    @property
    def stats(self) -> client_lib.ClientStats:
        return self._client.stats if self._client is not None else client_lib.ClientStats()

    @property
    def budget_reached(self) -> bool:
        """The leader's client heard it (and set the leader's stop, which the unit agrees on)."""
        return self._client is not None and self._client.budget_reached

    def start(self, timeout_s: float) -> syncer_pb2.RunConfig:
        """The leader joins; every process gets the run configuration (or the same error)."""
        outcome, payload, error = _JOIN_OK, b"", None
        if self._client is not None:
            try:
                payload = self._client.start(timeout_s).SerializeToString()
            except client_lib.FencedError as exc:
                outcome, error = _JOIN_FENCED, exc
            except TimeoutError as exc:
                outcome, error = _JOIN_TIMEOUT, exc
            except Exception as exc:  # noqa: BLE001 - every process must leave start() alike
                outcome, error = _JOIN_ERROR, exc
        outcome = self._unit.agree_int(outcome)
        if outcome == _JOIN_FENCED:
            raise error or client_lib.FencedError("the syncer refused this learner unit (seen by process 0)")
        if outcome == _JOIN_TIMEOUT:
            raise error or TimeoutError("process 0 of this learner unit could not join the syncer")
        if outcome != _JOIN_OK:
            raise error or RuntimeError("process 0 of this learner unit failed to join the syncer")
        self.run_config = syncer_pb2.RunConfig.FromString(self._unit.agree_bytes(payload))
        self.data_shard = self._unit.agree_int(self._client.data_shard if self._client is not None else 0)
        self.schedule_start_step = self._unit.agree_int(
            self._client.schedule_start_step if self._client is not None else 0)
        plan = serde.plan_from_proto(self.run_config.fragments, self.run_config.sync_period_steps)
        self._numels = [f.numel for f in plan.fragments]
        return self.run_config

    def take_updates(self) -> list[client_lib.GlobalFragment]:
        """Collective: the fragments the leader received since the last call, on every process.

        Also agrees on stopping (any process's stop request), on being fenced off (the leader's),
        on the round calls and on the upload outcomes, exposed as `stop_agreed`, `fenced`,
        `take_calls()` and `take_outcomes()` until the next call.
        """
        num = len(self._numels)
        header = np.zeros(_HEADER_INTS + _PER_FRAGMENT_INTS * num, np.int64)
        header[0] = int(self._stop.is_set())
        updates: dict[int, client_lib.GlobalFragment] = {}
        outcomes: list[client_lib.UploadOutcome] = []
        if self._client is not None:
            # Outcomes before updates, as the loop takes them from a plain SyncClient.
            outcomes = self._client.take_outcomes()
            calls = self._client.take_calls()
            updates = {u.fragment_id: u for u in self._client.take_updates()}
            header[1] = int(self._client.fenced is not None)
            header[2] = len(outcomes)
            for fid in range(num):
                row = header[_HEADER_INTS + _PER_FRAGMENT_INTS * fid: _HEADER_INTS + _PER_FRAGMENT_INTS * (fid + 1)]
                update = updates.get(fid)
                if update is not None:
                    row[0:4] = (1, update.version, _instance_tag(update.syncer_instance), update.merged_through_step)
                    row[4] = int(self._sent_values(fid, update.merged_through_step) is not None)
                call = calls.get(fid)
                if call is not None:
                    row[5:7] = (1, call.version)
                    row[7] = call.round
        gathered = np.asarray(multihost_utils.process_allgather(_int64_bytes(header)))
        rows = [_from_int64_bytes(row) for row in gathered.reshape(self._unit.process_count, -1)]
        leader = rows[0]
        self.exchanges += 1
        self.stop_agreed = any(bool(row[0]) for row in rows)
        if leader[1] and self.fenced is None:
            self.fenced = (self._client.fenced if self._client is not None and self._client.fenced
                           else client_lib.FencedError("a newer life of this learner unit joined (seen by process 0)"))
        out = []
        for fid in range(num):
            present, version, tag, mark, has_sent, called, call_version, call_round = (
                int(v) for v in leader[_HEADER_INTS + _PER_FRAGMENT_INTS * fid:
                                       _HEADER_INTS + _PER_FRAGMENT_INTS * (fid + 1)])
            if called:
                self._calls[fid] = syncer_pb2.RoundCall(fragment_id=fid, version=call_version, round=call_round)
            if not present:
                continue
            mine = updates.get(fid)
            values = (np.asarray(mine.values, np.float32) if mine is not None
                      else np.zeros(self._numels[fid], np.float32))
            values = np.asarray(multihost_utils.broadcast_one_to_all(values), np.float32)
            if has_sent:
                sent = self._sent_values(fid, mark)
                sent = np.asarray(multihost_utils.broadcast_one_to_all(
                    sent if sent is not None else np.zeros(self._numels[fid], np.float32)), np.float32)
                job = self._jobs.get(fid)
                if job is not None and job.local_step == mark:
                    job.sent_values = sent
            if mine is not None:
                out.append(mine)
            else:
                out.append(client_lib.GlobalFragment(fid, version, f"leader-instance-{tag & (2**64 - 1):016x}",
                                                     values, merged_through_step=mark))
        if leader[2]:
            payload = json.dumps([dataclasses.astuple(o) for o in outcomes]).encode() if self._client else b""
            self._outcomes.extend(client_lib.UploadOutcome(*o) for o in json.loads(self._unit.agree_bytes(payload)))
        return out

    def _sent_values(self, fid: int, mark: int) -> np.ndarray | None:
        """The leader's decoded values of the job a receipt names (None: lossless, or not ours)."""
        job = self._jobs.get(fid)
        if mark <= 0 or job is None or job.local_step != mark:
            return None
        return job.sent_values

    def take_calls(self) -> dict[int, syncer_pb2.RoundCall]:
        """The round calls the last exchanges agreed on (newest per fragment); not collective."""
        out, self._calls = self._calls, {}
        return out

    def take_outcomes(self) -> list[client_lib.UploadOutcome]:
        """The upload outcomes the last exchanges agreed on, in order; not collective."""
        out, self._outcomes = self._outcomes, []
        return out

    def agree_any(self, flag: bool) -> bool:
        """Collective: True on every process when `flag` is True on any."""
        gathered = np.asarray(multihost_utils.process_allgather(_int64_bytes([int(flag)])))
        return any(int(_from_int64_bytes(row)[0]) for row in gathered.reshape(self._unit.process_count, -1))

    def arrivals(self) -> dict[int, int]:
        """Not counted for a unit: `finish` only passes this back to `wait_for_arrivals`."""
        return {}

    def held_values(self) -> dict[int, tuple[int, np.ndarray]]:
        """Nothing: only the synchronous baselines' barrier asks (never run by a unit)."""
        return {}

    def take_refused(self) -> set[tuple[int, str, int]]:
        """Nothing: only the synchronous baselines resend on a refusal (never run by a unit)."""
        return set()

    def wait_for_arrivals(self, after: dict[int, int], timeout_s: float) -> bool:
        """A pause of `timeout_s` on every process (the next `take_updates` agrees on what came)."""
        self._stop.wait(timeout_s)
        return False

    def submit_upload(self, job: client_lib.UploadJob) -> None:
        self._jobs[job.fragment_id] = job
        if self._client is not None:
            self._client.submit_upload(job)

    def set_progress(self, request: syncer_pb2.ReportProgressRequest) -> None:
        if self._client is not None:
            self._client.set_progress(request)

    def flush(self, timeout_s: float) -> bool:
        return self._client.flush(timeout_s) if self._client is not None else True

    def close(self, *, leave: bool, timeout_s: float = 5.0) -> None:
        if self._client is not None:
            self._client.close(leave=leave, timeout_s=timeout_s)


def _instance_tag(instance: str) -> int:
    """A 63-bit tag of a syncer instance id: the other processes compare versions by it."""
    return int.from_bytes(hashlib.sha256(instance.encode()).digest()[:8], "little") >> 1


def init_unit_from_config(cfg) -> LearnerUnit:
    """`init_unit` from a LearnerConfig, then checks every process of the unit has the same
    configuration where it matters (identity, data, batch, devices)."""
    unit = init_unit(
        num_devices=cfg.num_devices, mesh_shape=cfg.mesh_shape, fsdp=cfg.fsdp,
        coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes, process_id=cfg.process_id,
        batch_size=cfg.batch_size, initialization_timeout_s=max(1, int(cfg.join_timeout_s)),
    )
    unit.check_same({name: getattr(cfg, name) for name in (
        "learner_id", "batch_size", "seed", "data_dir", "data_source", "heldout_dir", "token_dtype", "max_corpus_bytes", "num_shards",
        "shard_index", "heldout_fraction", "learning_rate", "warmup_steps", "lr_decay_steps",
        "lr_final_fraction", "weight_decay", "steps",
        "num_devices", "mesh_shape", "fsdp", "num_processes", "incarnation",
    )})
    return unit
