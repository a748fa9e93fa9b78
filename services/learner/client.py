"""SyncClient: the learner's connection to the syncer, run beside the training loop.

The training loop never waits on the network. It talks to this client through three
non-blocking, thread-safe calls: `submit_upload` (latest job per fragment wins), `take_updates`
(the newest global version of each fragment received since the last call) and `set_progress`
(the latest metadata snapshot, sent coalesced). Everything else happens on the client's own
asyncio loop in a background thread:

- a session supervisor that joins, then runs the fragment watch stream, the progress reporter and
  the uploader; when the session breaks (syncer restart, network loss) it re-joins with jittered,
  capped backoff for as long as the learner runs, while training goes on;
- bounded retries (tenacity) of idempotent calls on UNAVAILABLE / DEADLINE_EXCEEDED;
- a deadline on every call: unary calls get `call_timeout_s`, uploads a deadline scaled by their
  size, and the watch stream is re-opened every `watch_stream_max_s` (it is resumable).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping

import grpc
import numpy as np

from ddiloco import failpoints as failpoints_lib
from ddiloco import history as history_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import errors as errors_lib
from ddiloco.rpc import retry as retry_lib
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.learner import targets as targets_lib

_LOG = logging.getLogger("ddiloco.learner")

MIN_PROGRESS_INTERVAL_S = 0.02  # the fastest a learner reports progress (see _progress_interval_s)

# Upload endings that are not the syncer's verdict: the upload may or may not have been taken.
_OUTCOME_UNKNOWN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED})
_UNKNOWN_OUTCOME_PAUSE_S = 0.2
# The status the grpc asyncio client gives a call whose write failed in the core because the call
# had already ended (grpc/aio/_call.py: set_internal_error), replacing the status that ended it
# (grpc/grpc#36066): a broken link, a deadline, or a refusal while chunks were still being written.
_WRITE_FAILED_DETAILS = "Internal error from Core"
# The longest back-pressure hold honoured: a syncer's hint is advice, not a reason to stall a fragment.
_MAX_UPLOAD_HOLD_S = 60.0
# Refusals (ServiceError.reason, sent as trailing metadata) that end the session: this life of the
# learner is not (or no longer) a member, so the next step is a re-join.
_REJOIN_REASONS = frozenset({errors_lib.REASON_FENCED, errors_lib.REASON_NOT_JOINED})
# Refusals after which the same base may be sent again (the contribution was not taken, and a later
# try can succeed); INVALID_ARGUMENT, PERMISSION_DENIED, ALREADY_EXISTS and the like are final.
_RESENDABLE = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.CANCELLED})


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    target: str
    learner_id: str
    incarnation: int
    region: str
    tokens_per_step: int
    model_fingerprint: str = ""
    call_timeout_s: float = 10.0  # deadline of unary calls
    retry_bound_s: float = 30.0  # overall bound of one call's retries
    upload_min_bandwidth_bytes_per_s: float = 1e6  # upload deadline = base + size / this
    watch_stream_max_s: float = 600.0  # deadline of one watch stream; it is then resumed
    progress_interval_s: float = 0.25
    reconnect_max_backoff_s: float = 5.0
    # Fragments uploaded at once (one upload in flight per fragment); the syncer's default
    # --max-concurrent-uploads-per-learner is 4.
    max_concurrent_uploads: int = 4
    security: security_lib.ClientSecurity | None = None  # None: plaintext, no credentials
    # TESTS AND CHAOS ONLY: crash points (ddiloco.failpoints) and a JSONL history of the
    # syncer's acknowledgements of this learner's uploads (ddiloco.history).
    failpoints: str = ""
    history_file: str = ""
    # fragment id -> the values this learner computes for itself from the run's configuration
    # (its own initialization with RunConfig.init_seed). At the first join, fragments whose
    # values hash to the syncer's published sha256 are held without being downloaded.
    initial_values: Callable[[syncer_pb2.RunConfig], Mapping[int, np.ndarray]] | None = None
    # Quantizes uploads: codec.encode (the host codec) or jax_codec.encode (same signature, same
    # bytes). The learner's --upload-encoder chooses; the client itself never imports JAX.
    encode: Callable[..., codec_lib.EncodedPayload] = codec_lib.encode
    # Called once (from the client's thread) when the syncer answers a progress report with
    # budget_reached: the run's token budget is spent and the learner should stop stepping.
    on_budget_reached: Callable[[], None] | None = None
    # The learner's data (JoinRequest.num_data_shards; 0: not reported): the shard it chose itself,
    # or -1 to take the one the syncer assigns at the first join; fallback_data_shard is used when
    # the syncer assigns none (an older syncer). Once known, the shard is pinned for every re-join.
    num_data_shards: int = 0
    data_shard: int = -1
    fallback_data_shard: int = 0


@dataclasses.dataclass
class UploadJob:
    fragment_id: int
    base_version: int
    syncer_instance: str
    steps: int
    tokens: int
    delta: np.ndarray  # flat float32: global base - local
    local_step: int = 0  # the learner's step when the delta was taken (UploadHeader.local_step)
    final: bool = False  # the learner's last contribution of this fragment
    # Set by the client once encoded: the values the syncer will decode (the delta through a lossy
    # upload codec), which is what a merge adds to the global model (ddiloco.algo.arrival).
    sent_values: np.ndarray | None = None


# UploadOutcome.result values.
OUTCOME_ACCEPTED = "accepted"  # in the fragment's next merge (unless that round is dropped)
OUTCOME_DUPLICATE = "duplicate"  # accepted before (a retry)
OUTCOME_NOT_TAKEN = "not_taken"  # refused, failed, superseded or for another syncer life: never merged


@dataclasses.dataclass(frozen=True)
class UploadOutcome:
    fragment_id: int
    local_step: int
    result: str
    current_version: int = 0  # the fragment's version when the syncer accepted it


@dataclasses.dataclass(frozen=True)
class GlobalFragment:
    fragment_id: int
    version: int
    syncer_instance: str
    values: np.ndarray  # flat float32
    # The MergeReceipt: the highest local_step mark of this learner's contributions the version holds.
    merged_through_step: int = 0


@dataclasses.dataclass
class ClientStats:
    uploads_accepted: int = 0
    uploads_duplicate: int = 0
    uploads_failed: int = 0
    uploads_refused: int = 0
    uploads_slowed: int = 0  # accepted with a back-pressure hint (UploadFragmentResponse.next_upload_after_s)
    last_upload_hold_s: float = 0.0  # the last such hint honoured
    fragments_received: int = 0
    fragments_seeded: int = 0  # held from the learner's own initialization (hash-checked), not downloaded
    delta_fragments_received: int = 0  # of which sent as deltas (lossy download codec)
    sessions: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class FencedError(RuntimeError):
    """A newer life of this learner joined: this process must stop."""


class _SessionBroken(Exception):
    """The session must be re-established (re-join, new watch stream)."""


class _NotLeader(targets_lib.NotLeader, _SessionBroken):
    """A session that reached a syncer which does not lead."""


class SyncClient:
    """See the module docstring. Start with `start()`, stop with `close()`."""

    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self.stats = ClientStats()
        self.run_config: syncer_pb2.RunConfig | None = None
        self.instance = ""
        self._header_ack = False  # the syncer acknowledges upload headers (JoinResponse.upload_header_ack)
        self._pipeline_bytes = 0  # chunks sent ahead of that acknowledgement (JoinResponse.upload_pipeline_bytes)
        # fragment -> loop time before which its next upload waits (the syncer's back-pressure,
        # UploadFragmentResponse.next_upload_after_s); newer work of the fragment supersedes the
        # queued job meanwhile, so the periods in between go out as one contribution.
        self._hold_until: dict[int, float] = {}
        self._lock = threading.Lock()
        self._inbox: dict[int, GlobalFragment] = {}
        self._held: dict[int, int] = {}  # versions received (of self.instance)
        self._values: dict[int, np.ndarray] = {}  # the values of those versions (deltas apply to them)
        self._arrivals: dict[int, int] = {}  # fragment -> versions received so far (any instance)
        self._arrived = threading.Condition(self._lock)
        self._uploads: dict[int, UploadJob] = {}
        # (fragment, syncer instance, base version) of uploads the syncer refused without taking
        # them: the loop may send that base again (see take_refused).
        self._refused: set[tuple[int, str, int]] = set()
        self._outcomes: list[UploadOutcome] = []
        self._calls: dict[int, syncer_pb2.RoundCall] = {}  # fragment -> the newest round call
        self._receipts: dict[int, syncer_pb2.MergeReceipt] = {}  # received ahead of their version
        self._progress: syncer_pb2.ReportProgressRequest | None = None
        self._progress_sent: syncer_pb2.ReportProgressRequest | None = None
        self.fenced: FencedError | None = None
        self.budget_reached = False  # the syncer said the run's token budget is spent
        # The data shard this life trains (ClientConfig.data_shard), known after the first join.
        self.data_shard = cfg.data_shard if cfg.num_data_shards else -1
        # Inner steps this learner id's earlier lives ran (JoinResponse.schedule_start_step), from
        # the first join: where this life's LR schedule starts.
        self.schedule_start_step = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sync-client", daemon=True)
        self._upload_wakeup: asyncio.Event | None = None
        self._closing = False
        self._channel: grpc.aio.Channel | None = None
        self._stub: syncer_pb2_grpc.SyncerStub | None = None
        self._supervisor: asyncio.Future | None = None
        self._joined = threading.Event()
        self._sending: set[int] = set()  # fragments with an upload in flight
        self._seed_checked = False
        # Leader election (docs/failover.md): the syncers to try, the one in use, the leader a
        # standby named, and the newest leader epoch seen (versions of older epochs are ignored).
        self._targets = targets_lib.SyncerTargets(cfg.target)
        self.max_epoch = 0
        self._failpoints = failpoints_lib.Failpoints(cfg.failpoints, prefix="learner.")
        self._history = history_lib.HistoryWriter(cfg.history_file) if cfg.history_file else None

    # ---------------------------------------------------------------- training-thread API

    def start(self, timeout_s: float) -> syncer_pb2.RunConfig:
        """Joins and waits until every global fragment has arrived (bounded by timeout_s).

        Raises TimeoutError if the syncer cannot be reached in time, FencedError if refused.
        """
        self._thread.start()
        self._supervisor = asyncio.run_coroutine_threadsafe(self._supervise(), self._loop)
        if not self._joined.wait(timeout_s):
            raise TimeoutError(f"could not join the syncer at {self.cfg.target} within {timeout_s:.0f} s")
        if self.fenced:
            raise self.fenced
        deadline = threading.Event()
        waited = 0.0
        while waited < timeout_s:
            with self._lock:
                if self.run_config is not None and len(self._inbox) >= self.run_config.num_fragments:
                    return self.run_config
            if self.fenced:
                raise self.fenced
            deadline.wait(0.05)
            waited += 0.05
        raise TimeoutError(f"did not receive the global parameters within {timeout_s:.0f} s")

    def submit_upload(self, job: UploadJob) -> None:
        """Queues an upload; a queued, not yet started upload of the same fragment is replaced."""
        with self._lock:
            replaced = self._uploads.get(job.fragment_id)
            self._uploads[job.fragment_id] = job
            if replaced is not None and replaced is not job:
                self._outcomes.append(UploadOutcome(replaced.fragment_id, replaced.local_step, OUTCOME_NOT_TAKEN))
        if self._upload_wakeup is not None:
            self._loop.call_soon_threadsafe(self._upload_wakeup.set)

    def take_refused(self) -> set[tuple[int, str, int]]:
        """(fragment, syncer instance, base version) of uploads refused since the last call, for a
        reason a later upload on the same base can get past (an open round, admission, a lost
        connection). The loop sends once per base version; without this, a refused upload would
        leave the fragment without this learner's contribution until a new version arrives, and
        a round that needs it to reach quorum would never merge (the fragment stalls)."""
        with self._lock:
            out, self._refused = self._refused, set()
        return out

    def take_outcomes(self) -> list[UploadOutcome]:
        """What became of submitted uploads since the last call, in order."""
        with self._lock:
            out, self._outcomes = self._outcomes, []
        return out

    def take_calls(self) -> dict[int, syncer_pb2.RoundCall]:
        """The syncer's round calls received since the last call (the newest per fragment)."""
        with self._lock:
            out, self._calls = self._calls, {}
        return out

    def _requeue(self, job: UploadJob) -> None:
        """Queues a job whose fate is unknown again, unless a newer one of its fragment waits."""
        with self._lock:
            self._uploads.setdefault(job.fragment_id, job)

    def _outcome(self, job: UploadJob, result: str, current_version: int = 0) -> None:
        with self._lock:
            self._outcomes.append(UploadOutcome(job.fragment_id, job.local_step, result, current_version))

    def take_updates(self) -> list[GlobalFragment]:
        """The newest received version of each fragment since the last call (never blocks)."""
        with self._lock:
            out = list(self._inbox.values())
            self._inbox.clear()
        return out

    def held_values(self) -> dict[int, tuple[int, np.ndarray]]:
        """fragment -> (version, values) of the newest global version received from the current
        syncer instance (the values deltas apply to)."""
        with self._lock:
            return {f: (v, self._values[f]) for f, v in self._held.items() if f in self._values}

    def arrivals(self) -> dict[int, int]:
        """How many versions of each fragment have arrived so far (for `wait_for_arrivals`)."""
        with self._lock:
            return dict(self._arrivals)

    def wait_for_arrivals(self, after: dict[int, int], timeout_s: float) -> bool:
        """Blocks until every fragment in `after` received a version beyond the count given there
        (a synchronous mode's barrier); False on timeout or when the client is fenced or closing."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while not all(self._arrivals.get(f, 0) > n for f, n in after.items()):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.fenced or self._closing:
                    return False
                self._arrived.wait(min(remaining, 0.5))
            return True

    def flush(self, timeout_s: float) -> bool:
        """Waits (bounded) until queued uploads are sent or abandoned; True if the queue drained."""
        waited_s = 0.0
        while waited_s < timeout_s:
            with self._lock:
                if not self._uploads and not self._sending:
                    return True
            threading.Event().wait(0.05)
            waited_s += 0.05
        return False

    def set_progress(self, request: syncer_pb2.ReportProgressRequest) -> None:
        with self._lock:
            self._progress = request

    def agree_any(self, flag: bool) -> bool:
        """A single process agrees with itself (a multi-process unit's client agrees across processes)."""
        return flag

    def hit_failpoint(self, name: str) -> None:
        """Fault tests only: the action armed at `name` by ClientConfig.failpoints (none: nothing).
        The training loop's points (`learner.inner_step`) go through here so that the learner's
        wiring holds one failpoint table, the client's."""
        self._failpoints.hit(name)

    def close(self, *, leave: bool, timeout_s: float = 5.0) -> None:
        """Stops the client; with `leave`, tells the syncer first (best effort, bounded)."""
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(leave), self._loop)
        try:
            fut.result(timeout_s)
        except Exception as exc:  # shutting down: report and carry on
            _LOG.warning(f"sync client shutdown: {exc!r}")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    # ---------------------------------------------------------------- client-loop internals

    async def _shutdown(self, leave: bool) -> None:
        self._closing = True
        with self._lock:
            last = self._progress if self._progress is not self._progress_sent else None
        if leave and last is not None and self._stub is not None and self.instance:
            try:  # the final counts (tokens processed) reach the syncer before the learner leaves
                await self._stub.ReportProgress(last, timeout=self.cfg.call_timeout_s)
                self._progress_sent = last
            except grpc.RpcError as exc:
                _LOG.info(f"last progress report not acknowledged: {exc.code().name}")
        if leave and self._stub is not None and self.instance:
            try:
                await self._stub.Leave(
                    syncer_pb2.LeaveRequest(protocol_version=serde.PROTOCOL_VERSION, learner_id=self.cfg.learner_id,
                                            incarnation=self.cfg.incarnation),
                    timeout=self.cfg.call_timeout_s,
                )
            except grpc.RpcError as exc:
                _LOG.info(f"leave not acknowledged: {exc.code().name}")
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def _connect(self) -> None:
        """Points the stub at the syncer the next session should use (services/learner/targets.py)."""
        previous = self._targets.current
        target = self._targets.next()
        if target == previous and self._channel is not None:
            return
        if self._channel is not None:
            await self._channel.close()
        self._channel = channel_lib.aio_channel(target, self.cfg.security)
        self._stub = syncer_pb2_grpc.SyncerStub(self._channel)

    async def _supervise(self) -> None:
        self._upload_wakeup = asyncio.Event()
        failures = 0
        while not self._closing:
            try:
                await self._connect()
                await self._join()
                failures = 0
                self.stats.sessions += 1
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._watch())
                    group.create_task(self._report_progress())
                    group.create_task(self._upload_loop())
            except FencedError as exc:
                self.fenced = exc
                self._joined.set()
                _LOG.error(str(exc))
                return
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - any session failure leads to a re-join
                cause = exc.exceptions[0] if isinstance(exc, BaseExceptionGroup) else exc
                if isinstance(cause, FencedError):
                    self.fenced = cause
                    self._joined.set()
                    _LOG.error(str(cause))
                    return
                if self._closing:
                    return
                leader = self._targets.redirected(cause)
                if leader:
                    _LOG.info(f"{self._targets.current} is not the leader; going to {leader}")
                    continue
                failures += 1
                detail = cause.code().name if isinstance(cause, grpc.RpcError) else repr(cause)
                _LOG.warning(f"session with the syncer at {self._targets.current} broke ({detail}); re-joining")
            # Jittered, capped exponential backoff: a restarting syncer is not stampeded.
            delay_s = min(self.cfg.reconnect_max_backoff_s, 0.2 * 2 ** min(failures, 6))
            await asyncio.sleep(delay_s * random.uniform(0.5, 1.0))

    async def _join(self) -> None:
        request = syncer_pb2.JoinRequest(
            protocol_version=serde.PROTOCOL_VERSION,
            learner_id=self.cfg.learner_id,
            incarnation=self.cfg.incarnation,
            region=self.cfg.region,
            tokens_per_step=self.cfg.tokens_per_step,
            model_fingerprint=self.cfg.model_fingerprint,
            num_data_shards=self.cfg.num_data_shards,
            data_shard=max(self.data_shard, 0),
            assign_data_shard=self.cfg.num_data_shards > 0 and self.data_shard < 0,
        )
        async for attempt in retry_lib.async_retrying(
            what=f"Join {self._targets.current}", timeout=datetime.timedelta(seconds=self.cfg.retry_bound_s), idempotent=True
        ):
            with attempt:
                try:
                    response = await self._stub.Join(request, timeout=self.cfg.call_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    refusal = self._targets.not_leader(exc)
                    if refusal is not None:
                        raise _NotLeader(str(refusal), refusal.leader) from None
                    if len(self._targets.targets) > 1 and exc.code() in _OUTCOME_UNKNOWN:
                        # Another syncer of the list may lead: try it rather than wait for this one.
                        raise _SessionBroken(f"{self._targets.current}: {exc.code().name}") from None
                    if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                                      grpc.StatusCode.UNAUTHENTICATED):
                        # Fenced, or credentials that do not allow this learner id: retrying is futile.
                        raise FencedError(f"the syncer refused this learner ({exc.code().name}): {exc.details()}") from None
                    raise
        self.stats.bytes_sent += request.ByteSize()
        self.stats.bytes_received += response.ByteSize()
        # Epoch 0: a syncer without election (the operator turned it off), which is never deposed.
        if response.epoch and response.epoch < self.max_epoch:
            raise _NotLeader(f"{self._targets.current} leads with epoch {response.epoch}, older than {self.max_epoch}: "
                             "a deposed leader")
        self.max_epoch = response.epoch
        self._targets.joined()
        with self._lock:
            if response.syncer_instance != self.instance:
                # Versions are only meaningful within one syncer life: start from the full model.
                self._held.clear()
                if self.instance:
                    _LOG.info("syncer restarted (new instance): re-syncing every fragment")
            self.instance = response.syncer_instance
            self._header_ack = response.upload_header_ack
            self._pipeline_bytes = response.upload_pipeline_bytes
            self.run_config = response.config
            if request.assign_data_shard:  # the first join: the data it trains for this whole life
                self.data_shard = (response.data_shard if response.data_shard_assigned
                                   else self.cfg.fallback_data_shard)
            if not self._joined.is_set():  # re-joins (a restarted syncer) do not move the schedule
                self.schedule_start_step = response.schedule_start_step
        if self.cfg.initial_values is not None and not self._seed_checked:
            self._seed_checked = True  # once per life: a model-sized copy is not kept for re-joins
            await self._seed_from_initial_values(response)
        self._joined.set()

    async def _seed_from_initial_values(self, response: syncer_pb2.JoinResponse) -> None:
        """Holds every fragment whose own initial values hash to what the syncer publishes."""
        if not response.published_sha256:
            return  # a syncer that does not publish hashes: download everything
        versions = serde.versions_from_proto(response.fragment_versions)
        with self._lock:
            held = set(self._held)
        if not any(versions.get(fid) == 0 for fid in response.published_sha256 if fid not in held):
            # Only a fragment at version 0 (never merged in this syncer life) can hold the initial
            # values: a mid-run (re)start skips computing the model (~0.2 CPU-s of the tiny one).
            return
        try:
            local = await asyncio.to_thread(self.cfg.initial_values, response.config)
            hashes = await asyncio.to_thread(
                lambda: {fid: serde.params_sha256(v) for fid, v in local.items()})
        except Exception as exc:  # noqa: BLE001 - the download is the fallback, never a failure
            _LOG.warning(f"own initial values unavailable ({exc!r}); downloading every fragment")
            return
        seeded = []
        with self._arrived:
            for fid, sha in response.published_sha256.items():
                if fid in self._held or fid not in versions or hashes.get(fid) != sha:
                    continue
                values = np.asarray(local[fid], dtype=np.float32)
                self._inbox[fid] = GlobalFragment(fid, versions[fid], response.syncer_instance, values)
                self._held[fid] = versions[fid]
                self._values[fid] = values
                self._arrivals[fid] = self._arrivals.get(fid, 0) + 1
                seeded.append(fid)
            self._arrived.notify_all()
        self.stats.fragments_seeded += len(seeded)
        _LOG.info(f"{len(seeded)} of {len(response.published_sha256)} fragments held from this learner's own "
                  "initialization (sha256 equal to the syncer's); the others are downloaded")

    async def _watch(self) -> None:
        with self._lock:
            held = dict(self._held)
        request = syncer_pb2.WatchFragmentsRequest(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.cfg.learner_id,
            incarnation=self.cfg.incarnation, syncer_instance=self.instance, held=serde.versions_to_proto(held),
            accept_delta=True,
        )
        call = self._stub.WatchFragments(request, timeout=self.cfg.watch_stream_max_s)
        header = None
        assembler = None
        try:
            async for msg in call:
                self.stats.bytes_received += msg.ByteSize()
                kind = msg.WhichOneof("kind")
                if kind == "round_call":
                    with self._lock:
                        self._calls[msg.round_call.fragment_id] = msg.round_call
                    continue
                if kind == "receipt":
                    with self._lock:
                        self._receipts[msg.receipt.fragment_id] = msg.receipt
                    continue
                if kind == "header":
                    header = msg.header
                    assembler = serde.ChunkAssembler(header.payload.payload_size_bytes)
                    continue
                if assembler is None:
                    raise _SessionBroken("payload chunk without a header in the watch stream")
                assembler.add(msg.chunk)
                if assembler.done:
                    await self._receive(header, assembler.payload())
                    header = assembler = None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _SessionBroken("watch stream reached its deadline; resuming") from None
            raise
        raise _SessionBroken("the syncer ended the watch stream")

    async def _receive(self, header: syncer_pb2.GlobalFragmentHeader, payload: bytes) -> None:
        if header.epoch < self.max_epoch:  # never fold in a deposed leader's version
            raise _NotLeader(f"version {header.version} of fragment {header.fragment_id} has epoch {header.epoch}, "
                             f"older than {self.max_epoch}: {self._targets.current} was deposed")
        self.max_epoch = header.epoch
        values = await asyncio.to_thread(serde.decode_payload, header.payload, payload)
        fid = header.fragment_id
        if header.delta:
            with self._lock:
                held = self._held.get(fid) if header.syncer_instance == self.instance else None
                base = self._values.get(fid)
            if held != header.delta_base_version or base is None or base.size != values.size:
                # Cannot happen with a correct syncer (it sends a delta only against the version
                # this stream declared or received); re-watching gets exact values.
                raise _SessionBroken(f"delta for fragment {fid} against version {header.delta_base_version}, "
                                     f"but this learner holds {held}")
            values = serde.apply_delta(base, values)
            self.stats.delta_fragments_received += 1
        with self._arrived:
            receipt = self._receipts.pop(fid, None)
            mark = receipt.merged_through_step if receipt is not None and receipt.version == header.version else 0
            update = GlobalFragment(fid, header.version, header.syncer_instance, values, mark)
            if header.syncer_instance != self.instance:
                return
            self._inbox[fid] = update
            self._held[fid] = header.version
            self._values[fid] = values
            self._arrivals[fid] = self._arrivals.get(fid, 0) + 1
            self._arrived.notify_all()
        self.stats.fragments_received += 1
        if self._history is not None:  # fault tests check every version folded in against leader epochs
            self._history.write("version", instance=header.syncer_instance, fragment=fid, version=header.version,
                                epoch=header.epoch)

    async def _report_progress(self) -> None:
        while True:
            with self._lock:
                request = self._progress
            if request is not None and request is not self._progress_sent:
                try:
                    response = await self._stub.ReportProgress(request, timeout=self.cfg.call_timeout_s)
                    self.stats.bytes_sent += request.ByteSize()
                    self._progress_sent = request
                    if response.budget_reached and not self.budget_reached:
                        self.budget_reached = True
                        _LOG.info("the run's token budget is reached: finishing")
                        if self.cfg.on_budget_reached is not None:
                            self.cfg.on_budget_reached()
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        raise _SessionBroken(f"progress refused: {exc.details()}") from None
                    # Transient: the next snapshot is sent on the next tick; the watch stream
                    # notices a dead syncer on its own.
            await asyncio.sleep(self._progress_interval_s(request))

    def _progress_interval_s(self, request: syncer_pb2.ReportProgressRequest | None) -> float:
        """How long until the next progress report: the syncer's round schedule advances with the
        reports, so a learner reports at least twice per round slot (H / P steps) when its steps are
        fast, never more often than every MIN_PROGRESS_INTERVAL_S, and at most every
        `progress_interval_s`."""
        cfg = self.run_config
        if request is None or cfg is None or request.step_time_s <= 0 or not cfg.num_fragments:
            return self.cfg.progress_interval_s
        slot_s = request.step_time_s * cfg.sync_period_steps / cfg.num_fragments
        return min(self.cfg.progress_interval_s, max(MIN_PROGRESS_INTERVAL_S, 0.5 * slot_s))

    async def _upload_loop(self) -> None:
        # One upload in flight per fragment, fragments side by side. Sent one after another, an
        # upload the syncer holds (a fragment's first contributions wait for each other's to be
        # judged against, robust.DirectionPolicy.judge_wait_s) held back this learner's other
        # fragments, which other learners' held uploads were waiting for in turn: 4 learners
        # split 2/2 over two fragments all waited the full judge window.
        self._upload_wakeup.set()  # what was queued while the session was down goes out now
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as group:  # a broken session ends every upload
            while True:
                await self._upload_wakeup.wait()
                self._upload_wakeup.clear()
                now = loop.time()
                with self._lock:
                    waiting = [fid for fid in self._uploads if fid not in self._sending]
                    # A learner's last contribution of a fragment is never held: it is leaving.
                    ready = sorted(fid for fid in waiting
                                   if self._uploads[fid].final or self._hold_until.get(fid, 0.0) <= now)
                    held = [self._hold_until[fid] for fid in waiting if fid not in ready]
                    for fid in ready[:max(0, self.cfg.max_concurrent_uploads - len(self._sending))]:
                        self._sending.add(fid)
                        group.create_task(self._send(self._uploads.pop(fid)))
                if held:  # look again when the first hold ends
                    loop.call_at(min(held), self._upload_wakeup.set)

    async def _send(self, job: UploadJob) -> None:
        try:
            await self._upload(job)
        except asyncio.CancelledError:
            # The session broke mid-upload: the syncer may or may not have taken it. The same job
            # goes again once re-joined (idempotent on its key: a duplicate if it was taken), never
            # a new contribution carrying the same work (which would count it twice).
            self._requeue(job)
            raise
        finally:
            with self._lock:
                self._sending.discard(job.fragment_id)
            self._upload_wakeup.set()  # a newer upload of this fragment, or one over the limit, may wait

    async def _upload(self, job: UploadJob) -> None:
        cfg = self.run_config
        if job.syncer_instance != self.instance:
            # Based on another syncer life: worthless now. Whether that life merged it (and
            # checkpointed the merge) is for the new life's MergeReceipt to say, not this client.
            self.stats.uploads_refused += 1
            return
        codec = serde.codec_from_proto(cfg.upload_codec)
        try:
            encoded = await asyncio.to_thread(
                self.cfg.encode, job.delta, codec, block_size=cfg.upload_block_size, zstd_level=cfg.zstd_level
            )
        except codec_lib.NonFiniteError as exc:
            self.stats.uploads_refused += 1
            self._outcome(job, OUTCOME_NOT_TAKEN)
            _LOG.error(f"fragment {job.fragment_id} not sent: {exc}")
            return
        if encoded.codec != "fp32":
            job.sent_values = await asyncio.to_thread(serde.decode_payload, serde.payload_info_to_proto(encoded),
                                                      encoded.payload)
        header = syncer_pb2.UploadHeader(
            protocol_version=serde.PROTOCOL_VERSION, learner_id=self.cfg.learner_id, incarnation=self.cfg.incarnation,
            fragment_id=job.fragment_id, base_version=job.base_version, syncer_instance=job.syncer_instance,
            steps=job.steps, tokens=job.tokens, payload=serde.payload_info_to_proto(encoded),
            local_step=job.local_step, final=job.final,
        )
        messages = upload_messages(header, encoded.payload, cfg.chunk_size_bytes)
        wire_bytes = sum(m.ByteSize() for m in messages)
        timeout_s = self.cfg.call_timeout_s + wire_bytes / self.cfg.upload_min_bandwidth_bytes_per_s
        sent_at = time.time()
        try:
            async for attempt in retry_lib.async_retrying(
                what=f"upload fragment {job.fragment_id}", timeout=datetime.timedelta(seconds=self.cfg.retry_bound_s),
                idempotent=True,  # keyed on (learner, incarnation, fragment, base): never applied twice
            ):
                with attempt:
                    with self._lock:
                        superseded = job.fragment_id in self._uploads
                    if superseded:
                        self._outcome(job, OUTCOME_NOT_TAKEN)
                        return  # a newer pseudo-gradient of this fragment is queued; send that one
                    self.stats.bytes_sent += wire_bytes
                    if self._header_ack:
                        after_chunk = (lambda: self._failpoints.hit("learner.after_chunk")) if self._failpoints else None
                        response = await send_upload(self._stub, messages, timeout_s, after_chunk=after_chunk,
                                                     pipeline_bytes=self._pipeline_bytes)
                    else:
                        response = await self._stub.UploadFragment(self._request_stream(messages), timeout=timeout_s)
        except retry_lib.RetriesExhausted as exc:
            # An attempt may have been taken before the link failed: send the same job again later.
            self.stats.uploads_failed += 1
            self._requeue(job)
            self._record("failed", job, sent_at)
            _LOG.warning(str(exc))
            raise _SessionBroken("uploads keep failing") from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.INTERNAL and exc.details() == _WRITE_FAILED_DETAILS:
                # Not the syncer's verdict but the client's own: the call ended while this upload was
                # still being written, so the stream's end never went out and the syncer, which
                # takes an upload only at its end, did not take it. Whatever ended the call (a broken
                # link, most often), it is sent again like any upload whose call broke.
                _LOG.info(f"fragment {job.fragment_id} base {job.base_version}: the call ended while the "
                          "upload was being written (grpc reports INTERNAL, grpc/grpc#36066); sending it again")
                code = grpc.StatusCode.UNAVAILABLE
            if code in _OUTCOME_UNKNOWN:
                # Not the syncer's verdict (a reset stream, a cancelled call): the upload may have been
                # taken. The same job goes again after a short pause (idempotent on its key).
                self.stats.uploads_failed += 1
                self._record("failed", job, sent_at, code=code.name)
                await asyncio.sleep(_UNKNOWN_OUTCOME_PAUSE_S)
                self._requeue(job)
                return
            self.stats.uploads_refused += 1
            self._outcome(job, OUTCOME_NOT_TAKEN)
            _LOG.info(f"fragment {job.fragment_id} base {job.base_version} refused: {code.name}: {exc.details()}")
            self._record("refused", job, sent_at, code=code.name)
            if code == grpc.StatusCode.FAILED_PRECONDITION and errors_lib.reason_of(exc) in _REJOIN_REASONS:
                # The syncer's typed reason, not its wording: fenced off by a newer life (the re-join
                # is refused and sets `fenced`), or forgotten by a restarted syncer (the re-join works).
                raise _SessionBroken("the syncer no longer knows this learner") from None
            if code in _RESENDABLE:
                with self._lock:
                    self._refused.add((job.fragment_id, job.syncer_instance, job.base_version))
            return
        duplicate = response.result == syncer_pb2.UploadFragmentResponse.RESULT_DUPLICATE
        if response.next_upload_after_s > 0:  # back-pressure: the syncer is saturated
            self._hold_until[job.fragment_id] = (asyncio.get_running_loop().time()
                                                 + min(response.next_upload_after_s, _MAX_UPLOAD_HOLD_S))
            self.stats.uploads_slowed += 1
            self.stats.last_upload_hold_s = min(response.next_upload_after_s, _MAX_UPLOAD_HOLD_S)
        self._outcome(job, OUTCOME_DUPLICATE if duplicate else OUTCOME_ACCEPTED, response.current_version)
        self._record("ack", job, sent_at, result="duplicate" if duplicate else "accepted")
        if duplicate:
            self.stats.uploads_duplicate += 1
        else:
            self.stats.uploads_accepted += 1

    def _request_stream(self, messages: list):
        """The upload's messages; with the `learner.after_chunk` failpoint armed, a generator that
        may crash the process after a chunk went out (before the stream ends: a partial upload)."""
        if not self._failpoints:
            return iter(messages)

        def stream():
            for msg in messages:
                yield msg
                if msg.WhichOneof("kind") == "chunk":
                    self._failpoints.hit("learner.after_chunk")

        return stream()

    def _record(self, event: str, job: UploadJob, sent_at: float, **fields) -> None:
        """Appends to the fault-test history (`--history-file`), if any."""
        if self._history is not None:
            self._history.write(event, learner=self.cfg.learner_id, incarnation=self.cfg.incarnation,
                                instance=job.syncer_instance, fragment=job.fragment_id,
                                base_version=job.base_version, tokens=job.tokens, sent_at=sent_at, **fields)


def upload_messages(header: syncer_pb2.UploadHeader, payload: bytes, chunk_size_bytes: int) -> list:
    """The UploadFragment request messages of one upload: the header, then the payload's chunks."""
    return [syncer_pb2.UploadFragmentRequest(header=header)] + [
        syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(payload, chunk_size_bytes)]


async def send_upload(stub, messages: list, timeout_s: float, *, after_chunk=None, pipeline_bytes: int = 0):
    """One UploadFragment call to a syncer that acknowledges headers (JoinResponse.upload_header_ack):
    sends the header and the chunks that start within `pipeline_bytes` of the payload
    (JoinResponse.upload_pipeline_bytes) at once, and the rest only after the syncer accepted the
    header (initial metadata). The header's round trip thus overlaps the transfer.

    A refusal of the header still arrives while nothing is being written: the syncer reads the
    pipelined chunks (and, when they were the whole payload, the end of the stream) before it
    sends the status. The grpc asyncio client replaces the status of a call whose write fails
    after the status came in with INTERNAL (grpc/grpc#36066), which would hide refusals worth
    resending (_RESENDABLE).

    Args:
        stub: a SyncerStub on an aio channel.
        messages: the header message, then the chunk messages.
        timeout_s: the call's deadline.
        after_chunk: called after each chunk is written (the `learner.after_chunk` failpoint).
        pipeline_bytes: the syncer's pipeline window (0: no chunk before the acknowledgement).

    Returns:
        The UploadFragmentResponse. Raises grpc.aio.AioRpcError with the syncer's status.
    """
    call = stub.UploadFragment(timeout=timeout_s)
    ack = None
    first = messages[0]
    if pipeline_bytes:  # the syncer reads that much before refusing the header (a copy: messages are reused)
        first = syncer_pb2.UploadFragmentRequest()
        first.CopyFrom(messages[0])
        first.header.pipeline_bytes = pipeline_bytes
    try:
        await call.write(first)
        # Resolves once the header is accepted (the syncer's acknowledgement), or empty when the
        # call is ending: the status may not have been processed yet, so done() is no test here.
        ack = asyncio.ensure_future(call.initial_metadata())
        offset_bytes = 0
        acknowledged = False
        for msg in messages[1:]:
            if not acknowledged and offset_bytes >= pipeline_bytes:
                metadata = await ack
                if tuple(serde.UPLOAD_HEADER_ACK) not in [tuple(item) for item in (metadata or ())]:
                    return await call  # raises the refusal's status
                acknowledged = True
            if call.done():
                break  # refused mid-stream: awaiting the call raises its status
            await call.write(msg)
            offset_bytes += len(msg.chunk.data)
            if after_chunk is not None:
                after_chunk()
        else:
            await call.done_writing()
    except asyncio.InvalidStateError:
        pass  # the call ended between the check and the write: its status is raised below
    finally:
        if ack is not None and not ack.done():
            ack.cancel()
    return await call
