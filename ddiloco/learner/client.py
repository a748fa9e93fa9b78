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

The uploads (queue, encoding, retries, verdicts, back-pressure) are uploads.py's `Uploader`, a
mixin of SyncClient; this module keeps the session: join, watch, progress, shutdown.
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
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import shards as shards_lib
from ddiloco.learner import leader_watch as leader_watch_lib
from ddiloco.learner.progress import MIN_PROGRESS_INTERVAL_S, progress_interval_s  # noqa: F401 (re-exported)
from ddiloco.learner import targets as targets_lib
from ddiloco.learner import uploads as uploads_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import retry as retry_lib
from ddiloco.rpc import security as security_lib
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde

# The upload half lives in uploads.py; its names stay importable from here, where the loop, the
# tools and the tests have always found them.
from ddiloco.learner.uploads import (  # noqa: F401 (re-exported)
    OUTCOME_ACCEPTED,
    OUTCOME_DUPLICATE,
    OUTCOME_NOT_TAKEN,
    UploadJob,
    UploadOutcome,
    send_upload,
    upload_messages,
)

_LOG = logging.getLogger("ddiloco.learner")


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
    # With several syncers (leader election): how often the session's syncer is health-checked and
    # the deadline of one check; the other syncers are asked who leads only while it fails
    # (leader_watch.py), so a silent leader is left about a second after a standby took over.
    leader_check_interval_s: float = 1.0
    leader_check_timeout_s: float = 2.0
    # Fragments uploaded at once (one upload in flight per fragment); the syncer's default
    # --max-concurrent-uploads-per-learner is 4.
    max_concurrent_uploads: int = 4
    security: security_lib.ClientSecurity | None = None  # None: plaintext, no credentials
    # TESTS AND CHAOS ONLY: crash points (ddiloco.failpoints) and a JSONL history of the
    # syncer's acknowledgements of this learner's uploads (ddiloco.history).
    failpoints: str = ""
    history_file: str = ""
    # fragment id -> the values this learner computes for itself from the run's configuration (its own
    # init with RunConfig.init_seed): at the first join, those hashing to the syncer's published sha256 are held.
    initial_values: Callable[[syncer_pb2.RunConfig], Mapping[int, np.ndarray]] | None = None
    # Quantizes uploads: codec.encode or jax_codec.encode (same bytes; --upload-encoder; the client never imports JAX).
    encode: Callable[..., codec_lib.EncodedPayload] = codec_lib.encode
    # Called once (client thread) when a progress answer says budget_reached: the learner should stop stepping.
    on_budget_reached: Callable[[], None] | None = None
    # The learner's data (JoinRequest.num_data_shards; 0: not reported): the shard it chose itself, or -1 to take
    # the one the syncer assigns at the first join (none assigned: fallback_data_shard); then pinned for re-joins.
    num_data_shards: int = 0
    data_shard: int = -1
    fallback_data_shard: int = 0


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


class _NotLeader(targets_lib.NotLeader, uploads_lib.SessionBroken):
    """A session that reached a syncer which does not lead."""


class SyncClient(uploads_lib.Uploader):
    """See the module docstring. Start with `start()`, stop with `close()`."""

    def __init__(self, cfg: ClientConfig) -> None:
        self.cfg = cfg
        self.stats = ClientStats()
        self.run_config: syncer_pb2.RunConfig | None = None
        self.instance = ""
        # Fragment shards: the map the syncer answered (empty: unsharded), the entry joined (sharded.py).
        self.shards: list[syncer_pb2.SyncerShard] = []
        self.shard_index = 0
        self._header_ack = False  # the syncer acknowledges upload headers (JoinResponse.upload_header_ack)
        self._pipeline_bytes = 0  # chunks sent ahead of that acknowledgement (JoinResponse.upload_pipeline_bytes)
        # fragment -> loop time before which its next upload waits (the syncer's back-pressure,
        # UploadFragmentResponse.next_upload_after_s). Its round calls wait meanwhile (take_calls),
        # so the periods in between go out as one contribution, formed when the hold ends.
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
        self._started_at = 0.0
        self._sending: set[int] = set()  # fragments with an upload in flight
        self._seed_checked = False
        # Leader election (docs/failover.md): the syncers to try, the one in use, the leader a
        # standby named, and the newest leader epoch seen (versions of older epochs are ignored).
        self._targets = targets_lib.SyncerTargets(cfg.target)
        self._leader_watch = leader_watch_lib.LeaderWatch(
            self._targets.targets, interval_s=cfg.leader_check_interval_s, timeout_s=cfg.leader_check_timeout_s,
            security=cfg.security)
        self.max_epoch = 0
        self._failpoints = failpoints_lib.Failpoints(cfg.failpoints, prefix="learner.")
        self._history = history_lib.HistoryWriter(cfg.history_file) if cfg.history_file else None

    # ---------------------------------------------------------------- training-thread API

    def start(self, timeout_s: float) -> syncer_pb2.RunConfig:
        """Joins and waits until every global fragment has arrived (bounded by timeout_s).

        Raises TimeoutError if the syncer cannot be reached in time, FencedError if refused.
        """
        self._started_at = self._loop.time()  # (time.monotonic) for the join's log line
        self._thread.start()
        self._supervisor = asyncio.run_coroutine_threadsafe(self._supervise(), self._loop)
        if not self._joined.wait(timeout_s):
            raise TimeoutError(f"could not join the syncer at {self.cfg.target} within {timeout_s:.0f} s")
        if self.fenced:
            raise self.fenced
        deadline = threading.Event()
        waited = 0.0
        served = lambda: shards_lib.served_fragments(self.shards, self.shard_index, self.run_config)  # noqa: E731 (the shard's)
        while waited < timeout_s:
            with self._lock:
                if self.run_config is not None and all(fid in self._inbox for fid in served()):
                    return self.run_config
            if self.fenced:
                raise self.fenced
            deadline.wait(0.05)
            waited += 0.05
        raise TimeoutError(f"did not receive the global parameters within {timeout_s:.0f} s")

    def instance_of(self, fragment_id: int) -> str | None:
        return self.instance  # one syncer life for every fragment this session serves

    def take_calls(self) -> dict[int, syncer_pb2.RoundCall]:
        """The syncer's round calls received since the last call (the newest per fragment), except
        those of fragments whose next upload a back-pressure hold delays: such a call is handed over
        (or replaced by a newer one) once the hold ends. The loop forms a contribution when it takes
        a call and keeps one in flight per fragment, so a contribution formed during the hold sat
        queued on its base while the rounds went by without this learner, and was then refused as
        too stale (issue 20): held back here, the work stays local and goes out whole on a fresh base."""
        now = self._loop.time()  # the clock of _hold_until (time.monotonic, from any thread)
        with self._lock:
            out = {fid: call for fid, call in self._calls.items() if self._hold_until.get(fid, 0.0) <= now}
            for fid in out:
                del self._calls[fid]
        return out

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
        await self._leader_watch.close()
        if self._channel is not None:
            await self._channel.close()

    async def _connect(self) -> None:
        """Points the stub at the syncer the next session should use (ddiloco/learner/targets.py):
        with several syncers and no leader named, the one that answers SERVING first."""
        previous = self._targets.current
        serving = await self._leader_watch.first_serving(self._targets.targets) if self._targets.probing else ""
        target = self._targets.next(serving)
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
                # The leader watch runs beside the Join too: a Join hanging at a silent syncer (frozen,
                # or its host gone) is abandoned once another syncer of the list leads, not at its deadline.
                async with asyncio.TaskGroup() as joining:
                    watch = joining.create_task(self._leader_watch.watch(self._channel, self._targets.current))
                    await self._join()
                    watch.cancel()
                failures = 0
                self.stats.sessions += 1
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._watch())
                    group.create_task(self._report_progress())
                    group.create_task(self._upload_loop())
                    group.create_task(self._leader_watch.watch(self._channel, self._targets.current))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - any session failure leads to a re-join
                # A fence ends the client, raised by _join itself or from inside the session's group.
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
                    if len(self._targets.targets) > 1 and exc.code() in uploads_lib.OUTCOME_UNKNOWN:
                        # Another syncer of the list may lead: try it rather than wait for this one.
                        raise uploads_lib.SessionBroken(f"{self._targets.current}: {exc.code().name}") from None
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
        _LOG.info("joined the syncer", extra={"fields": {"syncer": self._targets.current, "epoch": response.epoch,
                                                        "since_start_s": round(self._loop.time() - self._started_at, 3)}})
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
            self.shards, self.shard_index = list(response.shards), response.shard_index
            if request.assign_data_shard:  # the first join: the data it trains for this whole life
                self.data_shard = (response.data_shard if response.data_shard_assigned
                                   else self.cfg.fallback_data_shard)
            if not self._joined.is_set():  # re-joins (a restarted syncer) do not move the schedule
                self.schedule_start_step = response.schedule_start_step
        if response.budget_reached:
            self._budget_reached("the run's token budget was reached before this life joined: finishing "
                                 "without an inner step")
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
                    raise uploads_lib.SessionBroken("payload chunk without a header in the watch stream")
                assembler.add(msg.chunk)
                if assembler.done:
                    await self._receive(header, assembler.payload())
                    header = assembler = None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise uploads_lib.SessionBroken("watch stream reached its deadline; resuming") from None
            raise
        raise uploads_lib.SessionBroken("the syncer ended the watch stream")

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
                raise uploads_lib.SessionBroken(f"delta for fragment {fid} against version {header.delta_base_version}, "
                                     f"but this learner holds {held}")
            values = fragments_lib.apply_delta(base, values)
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

    def _budget_reached(self, why: str) -> None:
        """The syncer said the run's token budget is spent: stop stepping (once)."""
        if self.budget_reached:
            return
        self.budget_reached = True
        _LOG.info(why)
        if self.cfg.on_budget_reached is not None:
            self.cfg.on_budget_reached()

    async def _report_progress(self) -> None:
        while True:
            with self._lock:
                request = self._progress
            if request is not None and request is not self._progress_sent:
                try:
                    response = await self._stub.ReportProgress(request, timeout=self.cfg.call_timeout_s)
                    self.stats.bytes_sent += request.ByteSize()
                    self._progress_sent = request
                    if response.budget_reached:
                        self._budget_reached("the run's token budget is reached: finishing")
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        raise uploads_lib.SessionBroken(f"progress refused: {exc.details()}") from None
                    # Transient: the next snapshot is sent on the next tick; the watch stream
                    # notices a dead syncer on its own.
            await asyncio.sleep(self._progress_interval_s(request))

    def _progress_interval_s(self, request: syncer_pb2.ReportProgressRequest | None) -> float:
        """How long until the next progress report to this session's syncer (`progress_interval_s`
        of the fragments it serves: all P, or a shard's F)."""
        cfg = self.run_config
        if request is None or cfg is None or request.step_time_s <= 0 or not cfg.num_fragments:
            return self.cfg.progress_interval_s
        served = len(shards_lib.served_fragments(self.shards, self.shard_index, cfg)) or cfg.num_fragments
        return progress_interval_s(request.step_time_s, cfg.sync_period_steps, served, self.cfg.progress_interval_s)

